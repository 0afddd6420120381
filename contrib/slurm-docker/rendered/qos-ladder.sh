#!/bin/sh
# The slurm-hai QOS ladder, rendered by `hai-admin render` from policy.toml.
# It creates the QOS (one per level, one per quota override) and grants them as if the
# database had none of them. On a live cluster prefer `hai-admin plan` / `hai-admin apply`:
# they compare with what Slurm has and change only what differs.
set -e

# new QOS: level EXTREME_HIGH: quota 1 node per user
sacctmgr -n -P show qos format=name | grep -qxF extreme_high || sacctmgr -i add qos extreme_high

# new QOS: level VERY_HIGH: quota 2 nodes per user
sacctmgr -n -P show qos format=name | grep -qxF very_high || sacctmgr -i add qos very_high

# new QOS: level HIGH: quota 2 nodes per user
sacctmgr -n -P show qos format=name | grep -qxF high || sacctmgr -i add qos high

# new QOS: level ABOVE_NORMAL: quota unlimited per user
sacctmgr -n -P show qos format=name | grep -qxF above_normal || sacctmgr -i add qos above_normal

# new QOS: level NORMAL: quota unlimited per user
sacctmgr -n -P show qos format=name | grep -qxF normal || sacctmgr -i add qos normal

# new QOS: level UNDER_NORMAL: quota unlimited per user
sacctmgr -n -P show qos format=name | grep -qxF under_normal || sacctmgr -i add qos under_normal

# new QOS: level BELOW_NORMAL: quota unlimited per user
sacctmgr -n -P show qos format=name | grep -qxF below_normal || sacctmgr -i add qos below_normal

# new QOS: level LOW: quota unlimited per user
sacctmgr -n -P show qos format=name | grep -qxF low || sacctmgr -i add qos low

# extreme_high: settings of the new QOS
sacctmgr -i modify qos where name=extreme_high set Priority=51 Preempt=above_normal,below_normal,high,low,normal,under_normal,very_high GraceTime=5 PreemptMode=requeue MaxTRESPU=node=1 Flags=DenyOnLimit

# very_high: settings of the new QOS
sacctmgr -i modify qos where name=very_high set Priority=41 Preempt=above_normal,below_normal,high,low,normal,under_normal GraceTime=5 PreemptMode=requeue MaxTRESPU=node=2 Flags=DenyOnLimit

# high: settings of the new QOS
sacctmgr -i modify qos where name=high set Priority=31 Preempt=above_normal,below_normal,low,normal,under_normal GraceTime=5 PreemptMode=requeue MaxTRESPU=node=2 Flags=DenyOnLimit

# above_normal: settings of the new QOS
sacctmgr -i modify qos where name=above_normal set Priority=21 Preempt=below_normal,low,normal,under_normal GraceTime=5 PreemptMode=requeue Flags=DenyOnLimit

# normal: settings of the new QOS
sacctmgr -i modify qos where name=normal set Priority=11 Preempt=below_normal,low,under_normal GraceTime=5 PreemptMode=requeue Flags=DenyOnLimit

# under_normal: settings of the new QOS
sacctmgr -i modify qos where name=under_normal set Priority=9 Preempt=below_normal,low GraceTime=5 PreemptMode=requeue Flags=DenyOnLimit

# below_normal: settings of the new QOS
sacctmgr -i modify qos where name=below_normal set Priority=6 Preempt=low GraceTime=5 PreemptMode=requeue Flags=DenyOnLimit

# low: settings of the new QOS
sacctmgr -i modify qos where name=low set Priority=1 GraceTime=5 PreemptMode=requeue Flags=DenyOnLimit

# users of account hai use the ladder
sacctmgr -i modify user where account=hai set qos=above_normal,below_normal,extreme_high,high,low,normal,under_normal,very_high defaultqos=normal || echo "  (no association to change)"

# account hai uses the ladder
sacctmgr -i modify account where name=hai set qos=above_normal,below_normal,extreme_high,high,low,normal,under_normal,very_high defaultqos=normal || echo "  (no association to change)"
