"""The HAI vocabulary and rules, pure (standard library only): levels, the policy file,
the QOS ladder as data, admin-comment tags, the daemon's decisions and `hai status` reasons."""
