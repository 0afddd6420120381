"""The controller side: the policy daemon's loop and `hai-admin apply`."""
