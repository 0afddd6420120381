-- job_submit.lua rendered by slurm-hai (templates/slurm/job_submit.lua.j2) from policy.toml.
-- Runs inside slurmctld under its locks: keep it small and fast (table look-ups only).
--  * maps the SPANK option --hai-priority (job env HAI_PRIORITY), or --qos=<level>, to the
--    level's QOS, or to the user's (account's) quota-override variant of it (<level>.u.<user>,
--    <level>.a.<account>), which carries that owner's node quota;
--  * refuses a job larger than the owner's whole quota at its level with a clear message
--    (the QOS's DenyOnLimit would refuse it too, with a vague one);
--  * AUTO (--hai-priority=AUTO or --qos=auto): the highest level of the job's node group whose
--    quota can ever hold the job; the policy daemon moves it down while that level's quota is
--    in use; a level its node group does not take is refused, in words;
--  * refuses a job that asks for fewer GPUs per node than its node group's min_gpus (HAI:
--    every job takes at least 8 GPUs, a whole node);
--  * stamps the submit-time level into admin_comment ("hai-level=NAME"), which users cannot
--    change, so the policy daemon can give a requeued job back its level;
--  * the job's grace: --hai-grace (job env HAI_GRACE), else "hai-grace=N" in the job's comment
--    (hai-submit --grace), else the policy's grace_seconds; refused above max_grace_seconds (the
--    QOS GraceTime), stamped into admin_comment ("hai-grace=N") for the policy daemon;
--  * an elastic job (--nodes=MIN-MAX): its range, stamped into admin_comment
--    ("hai-nodes=MIN:MAX:STEP"; the step from "hai-nodes=MIN:MAX:STEP" in the job's comment, which
--    hai-submit writes, when its MIN and MAX are the job's), since the job's own node count
--    is what the policy daemon changes when it resizes it. Quotas count MIN here (the job
--    can start on MIN); Slurm caps the nodes it gets at the QOS limits;
--  * an elastic job in place (hai-submit --in-place: a job array, "hai-parts=MIN:MAX" in its
--    comment): the tag, copied into admin_comment, so that accounting (which keeps no job
--    comment by default) knows the array's tasks as one job's parts (the timeline), with a
--    mark of this submission ("hai-submission=TIME.N.R", kept across the tasks' requeues):
--    the job's directory is this submission's, and one left by an older job whose id Slurm
--    gives again (after it lost its state) is moved aside (runtime/part_task.py).

local NO_VAL = 4294967294
local NO_VAL16 = 65534
-- Every table below is computed by slurm_hai/policy/placement.py (lua_tables) from the
-- policy: this script looks things up, it decides nothing the policy has not decided.
local default_level = "NORMAL"
local allow_auto = true
local default_grace = 5
local min_grace = 1
local max_grace = 5
local grace_tag = "hai-grace"
local nodes_tag = "hai-nodes"
local parts_tag = "hai-parts"
local submission_tag = "hai-submission"
local submissions = 0  -- in-place arrays this script has stamped since slurmctld loaded it
local choices = "EXTREME_HIGH(50), VERY_HIGH(40), HIGH(30), ABOVE_NORMAL(20), NORMAL(10), UNDER_NORMAL(8), BELOW_NORMAL(5), LOW(0)"
-- what a refused job is told (printf formats, the same words hai-submit says)
local refusal = {
  unknown_level = "unknown priority level '%s'; use one of %s or AUTO",
  no_auto = "priority AUTO is not allowed on this cluster; use one of %s",
  group_levels = "node group %s takes jobs at %s only; use one of those levels or AUTO",
  no_level_fits = "%d nodes exceed your quota at every level of node group %s; ask for fewer nodes",
  quota_zero = "your quota at %s is 0 nodes: that level is not open to you; use a lower level or AUTO",
  over_quota = "%d nodes at %s exceed your quota of %d nodes at that level; ask for at most %d or use a lower level",
  grace = "grace '%s' is not allowed on this cluster; ask for whole seconds from %d to %d (the policy's max_grace_seconds)",
}

-- highest level first
local order = {
  "EXTREME_HIGH",
  "VERY_HIGH",
  "HIGH",
  "ABOVE_NORMAL",
  "NORMAL",
  "UNDER_NORMAL",
  "BELOW_NORMAL",
  "LOW",
}
local levels = {
  ["EXTREME_HIGH"] = "extreme_high",
  ["VERY_HIGH"] = "very_high",
  ["HIGH"] = "high",
  ["ABOVE_NORMAL"] = "above_normal",
  ["NORMAL"] = "normal",
  ["UNDER_NORMAL"] = "under_normal",
  ["BELOW_NORMAL"] = "below_normal",
  ["LOW"] = "low",
}
local qos_level = {
  ["extreme_high"] = "EXTREME_HIGH",
  ["very_high"] = "VERY_HIGH",
  ["high"] = "HIGH",
  ["above_normal"] = "ABOVE_NORMAL",
  ["normal"] = "NORMAL",
  ["under_normal"] = "UNDER_NORMAL",
  ["below_normal"] = "BELOW_NORMAL",
  ["low"] = "LOW",
}
-- per-user node quota per level; a level not listed is unlimited
local quota = {
  ["EXTREME_HIGH"] = 1,
  ["VERY_HIGH"] = 2,
  ["HIGH"] = 2,
}
-- overrides: owner -> level -> {variant QOS, quota (-1: unlimited)}
local user_override = {
}
local account_override = {
}
-- node group (partition) -> the levels it takes, highest first (AUTO picks among them)
local group_levels = {
  ["cpu"] = { "EXTREME_HIGH", "VERY_HIGH", "HIGH", "ABOVE_NORMAL", "NORMAL", "UNDER_NORMAL", "BELOW_NORMAL", "LOW" },
}
-- the node groups that take only some levels, as users read them
local group_names = {
}
-- the 8-GPU rule: GPUs per node a job must ask for, by node group (partition); a partition
-- the policy does not name takes the top-level value, a job that names none the default group's
local min_gpus = 0
local group_min_gpus = {
  ["cpu"] = 0,
}
local default_group = "cpu"

local function spank_env(job_desc, name)
  local env = job_desc.spank_job_env
  if env == nil then return nil end
  -- 22.05 hands SPANK job-control variables to job_submit without the SPANK_ prefix
  local prefix = name .. "="
  for _, entry in pairs(env) do
    if type(entry) == "string" and string.sub(entry, 1, #prefix) == prefix then
      return string.sub(entry, #prefix + 1)
    end
  end
  return nil
end

-- the value of the tag `name` among the words of a comment ("k=v k2=v2" or "k=v;k2=v2"), or nil
local function comment_tag(comment, name)
  if comment == nil then return nil end
  local prefix = name .. "="
  local found = nil
  for word in string.gmatch(comment, "[^%s;]+") do
    if string.sub(word, 1, #prefix) == prefix then found = string.sub(word, #prefix + 1) end
  end
  return found
end

-- " nodes_tag=MIN:MAX:STEP" for an elastic job, "" for a fixed one
local function node_range(job_desc)
  local lo, hi = job_desc.min_nodes, job_desc.max_nodes
  if lo == nil or lo == 0 or lo >= NO_VAL or hi == nil or hi == 0 or hi >= NO_VAL or hi <= lo then return "" end
  local step = 1
  local asked = comment_tag(job_desc.comment, nodes_tag)
  if asked ~= nil then
    local a, b, s = string.match(asked, "^(%d+):(%d+):(%d+)$")
    a, b, s = tonumber(a), tonumber(b), tonumber(s)
    if a == lo and b == hi and s ~= nil and s >= 1 and (hi - lo) % s == 0 then step = s end
  end
  return string.format(" %s=%d:%d:%d", nodes_tag, lo, hi, step)
end

-- " parts_tag=MIN:MAX" for an elastic job in place (the tag of its comment, well formed), else ""
local function parts_range(job_desc)
  local lo, hi = string.match(comment_tag(job_desc.comment, parts_tag) or "", "^(%d+):(%d+)$")
  lo, hi = tonumber(lo), tonumber(hi)
  if lo == nil or hi == nil or lo < 1 or hi < lo then return "" end
  submissions = submissions + 1
  return string.format(" %s=%d:%d %s=%d.%d.%d", parts_tag, lo, hi, submission_tag, os.time(), submissions,
                       math.random(0, 999999))
end

-- the grace the job asked for, in whole seconds; nil and the refusal when it may not have it
local function job_grace(job_desc)
  local asked = spank_env(job_desc, "HAI_GRACE")
  if asked == nil then asked = comment_tag(job_desc.comment, grace_tag) end
  if asked == nil then return default_grace, nil end
  local n = string.match(asked, "^%d+$") and tonumber(asked)
  if n == nil or n < min_grace or n > max_grace then
    return nil, string.format(refusal.grace, asked, min_grace, max_grace)
  end
  return n, nil
end

-- the QOS and the quota (nil: unlimited) of `level` for this user/account
local function placement(user, account, level)
  local o = user ~= nil and user_override[user] and user_override[user][level]
  if not o then o = account ~= nil and account_override[account] and account_override[account][level] end
  if o then
    if o[2] < 0 then return o[1], nil end
    return o[1], o[2]
  end
  return levels[level], quota[level]
end

local function level_of_qos(qos)
  if qos == nil then return nil end
  -- a variant is <level>.u.<user> or <level>.a.<account> (levels.parse_qos); any other name is whole
  local name = string.lower(qos)
  local base = string.match(name, "^([^%.]*)%.[ua]%..+$")
  return qos_level[base or name]
end

-- GPUs in a TRES request: "gres:gpu:8" (22.05), "gres/gpu:8" (23.02 and later), with a type
-- ("gres/gpu:a100:8") or none ("gres/gpu": one); other TRES of the list count nothing
local function gpus_in(tres)
  if tres == nil then return 0 end
  local most = 0
  for entry in string.gmatch(tres, "[^,]+") do
    local spec = string.gsub(entry, "^gres[:/]", "")
    local n = nil
    if spec == "gpu" or string.match(spec, "^gpu:[^:]+$") and not string.match(spec, "^gpu:%d+$") then
      n = 1  -- "gpu" or "gpu:TYPE"
    else
      n = tonumber(string.match(spec, "^gpu:[^:]+:(%d+)$") or string.match(spec, "^gpu:(%d+)$"))
    end
    if n ~= nil and n > most then most = n end
  end
  return most
end

-- GPUs per node a job asks for: --gres/--gpus-per-node (tres_per_node), else --gpus
-- (tres_per_job) over its nodes, else --gpus-per-task times its tasks per node; 0 without any
local function gpus_per_node(job_desc, nodes)
  local n = gpus_in(job_desc.tres_per_node)
  if n > 0 then return n end
  n = gpus_in(job_desc.tres_per_job)
  if n > 0 then return math.floor(n / nodes) end
  n = gpus_in(job_desc.tres_per_task)
  if n > 0 then
    local per_node = job_desc.ntasks_per_node
    if per_node == nil or per_node == 0 or per_node >= NO_VAL16 then
      local tasks = job_desc.num_tasks
      if tasks == nil or tasks == 0 or tasks >= NO_VAL then tasks = nodes end
      per_node = math.floor(tasks / nodes)
    end
    return n * per_node
  end
  return 0
end

-- The 8-GPU rule: nil when the job asks for enough GPUs per node for its group (each group
-- it names, for a list of partitions), else the group it falls short of and what that needs
local function short_of_gpus(job_desc, gpus)
  local names = job_desc.partition
  if names == nil or names == "" then names = default_group end
  for name in string.gmatch(names, "[^,]+") do
    local need = group_min_gpus[name]
    if need == nil then need = min_gpus end
    if gpus < need then return name, need end
  end
  return nil
end

-- the node group whose rules the job follows: the first of its partitions the policy names,
-- the default group when it names none, nil when it names only partitions of the site's own
local function group_of(partition)
  if partition == nil or partition == "" then return default_group end
  for name in string.gmatch(partition, "[^,]+") do
    if group_levels[name] ~= nil then return name end
  end
  return nil
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  local nodes = job_desc.min_nodes
  if nodes == nil or nodes == 0 or nodes >= NO_VAL then nodes = 1 end
  local gpus = gpus_per_node(job_desc, nodes)
  local short, need = short_of_gpus(job_desc, gpus)
  if short ~= nil then
    slurm.log_user("hai: node group %s takes jobs of at least %d GPUs per node (whole nodes); this job asks for %d per node: use --gpus-per-node=%d", short, need, gpus, need)
    return slurm.ERROR
  end

  local wanted = spank_env(job_desc, "HAI_PRIORITY")
  if wanted == nil and job_desc.qos ~= nil then
    if string.lower(job_desc.qos) == "auto" then
      wanted = "AUTO"
    else
      wanted = level_of_qos(job_desc.qos)
      -- a QOS outside the ladder (the site's own) is left to Slurm
      if wanted == nil then return slurm.SUCCESS end
    end
  end
  if wanted == nil then wanted = default_level end
  wanted = string.upper(wanted)

  local user = job_desc.user_name
  local account = job_desc.account
  if account == nil then account = job_desc.default_account end

  -- in placement.place's order: the level named, the grace, then where the job fits
  if wanted == "AUTO" and not allow_auto then
    slurm.log_user("hai: " .. refusal.no_auto, choices)
    return slurm.ERROR
  elseif wanted ~= "AUTO" and levels[wanted] == nil then
    slurm.log_user("hai: " .. refusal.unknown_level, wanted, choices)
    return slurm.ERROR
  end
  local grace, grace_refused = job_grace(job_desc)
  if grace == nil then
    slurm.log_user("hai: %s", grace_refused)
    return slurm.ERROR
  end

  local group = group_of(job_desc.partition)
  local level = wanted
  if wanted == "AUTO" then
    level = nil
    local candidates = order
    if group ~= nil then candidates = group_levels[group] end
    for _, name in ipairs(candidates) do
      local _, q = placement(user, account, name)
      if q == nil or q >= nodes then level = name; break end
    end
    if level == nil then
      slurm.log_user("hai: " .. refusal.no_level_fits, nodes, group or "-")
      return slurm.ERROR
    end
  elseif group ~= nil and group_names[group] ~= nil then
    local takes = false
    for _, name in ipairs(group_levels[group]) do
      if name == wanted then takes = true end
    end
    if not takes then
      slurm.log_user("hai: " .. refusal.group_levels, group, group_names[group])
      return slurm.ERROR
    end
  end

  local qos, q = placement(user, account, level)
  if q ~= nil and nodes > q then
    if q == 0 then
      slurm.log_user("hai: " .. refusal.quota_zero, level)
    else
      slurm.log_user("hai: " .. refusal.over_quota, nodes, level, q, q)
    end
    return slurm.ERROR
  end
  job_desc.qos = qos
  job_desc.admin_comment = "hai-level=" .. wanted .. " " .. grace_tag .. "=" .. grace .. node_range(job_desc)
    .. parts_range(job_desc)
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end

slurm.log_info("slurm-hai job_submit.lua loaded")
return slurm.SUCCESS
