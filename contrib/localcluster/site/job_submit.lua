-- The site's own job_submit.lua (contrib/localcluster/site/, `up --site`): a job that names
-- no account is charged to the account "lab".
function slurm_job_submit(job_desc, part_list, submit_uid)
   if job_desc.account == nil then
      job_desc.account = "lab"
   end
   return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
   return slurm.SUCCESS
end

return slurm.SUCCESS
