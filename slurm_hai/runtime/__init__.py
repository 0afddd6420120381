"""Inside the job: the batch script's driver, the per-node launcher, the client API
(standard library only), spawn/distributed helpers (on the HAI environment contract,
policy/contract.py), and the local simulation (`hai run-local`). No click or jinja2 here."""
