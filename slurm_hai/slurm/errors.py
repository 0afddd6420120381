"""The errors of the Slurm boundary, in a module of their own: every module of slurm/ raises
them, and the package names them (`slurm_hai.slurm.SlurmError`) without loading a backend."""


class SlurmError(Exception):
    """A Slurm command or call failed; the message is one line a person can act on."""


class SlurmMissing(SlurmError):
    """No Slurm command can be run here (none on PATH, or not executable): a process in a
    container without Slurm's commands, as pyxis/enroot and Apptainer jobs have them."""
