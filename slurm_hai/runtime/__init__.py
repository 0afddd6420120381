"""Inside the job: the batch script's driver, the per-node launcher, the client API
(standard library only), the HAI environment contract, spawn/distributed helpers, and the
local simulation (`hai run-local`). No click or jinja2 here."""
