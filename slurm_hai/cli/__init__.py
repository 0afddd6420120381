"""click front ends: `hai-submit` (submit.py), `hai` (user.py), `hai-admin` (admin.py)."""
