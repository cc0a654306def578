"""A real one-node Slurm cluster on localhost for tests: munged + slurmctld + slurmd, everything under a tmp dir.

scripts/install_slurm.sh installs Debian's packages when missing (root + apt-get; otherwise the tests skip with
the reason). The daemons run in the foreground as our children and are stopped by their pids; every wait has a
timeout and `stop()` cancels the jobs first, so a hung job cannot hang the test session.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

from tools.common import free_port

ROOT = Path(__file__).resolve().parents[1]
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
PARTITION = "debug"
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
                "PREEMPTED"}


class SlurmUnavailable(Exception):
    """Slurm cannot be installed or started here; the message says why (the tests skip with it)."""


def install_slurm() -> None:
    """Run scripts/install_slurm.sh (a no-op when Slurm is installed); SlurmUnavailable when it cannot."""
    if os.name != "posix" or not shutil.which("apt-get") and not shutil.which("slurmctld", path=SBIN_PATH):
        raise SlurmUnavailable("no apt-get and no Slurm installed")
    try:
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "install_slurm.sh")], capture_output=True, text=True,
                              timeout=300)
    except subprocess.TimeoutExpired as err:
        raise SlurmUnavailable("installing Slurm took over 300 s") from err
    if proc.returncode != 0:
        raise SlurmUnavailable(f"scripts/install_slurm.sh failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")


class SlurmCluster:
    """`start()` brings the cluster up (node idle), `stop()` tears it down; `env` is what clients need."""

    def __init__(self, root: Path, cpus: int = 2):
        self.root, self.cpus = root, cpus
        self.conf = root / "slurm.conf"
        self.socket = root / "munge" / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "PATH": SBIN_PATH}
        self._daemons: list[subprocess.Popen] = []
        self.jobs: list[str] = []

    # -------------------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400)  # munged insists on a private key
        os.write(fd, os.urandom(1024))
        os.close(fd)
        self._write_conf()
        log = self.root / "log"
        self._spawn(["munged", "--foreground", "--force", f"--socket={self.socket}", f"--key-file={key}",
                     f"--log-file={log / 'munged.log'}", f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                     f"--seed-file={self.root / 'munge' / 'munged.seed'}"], log / "munged.out")
        self._wait(lambda: self.socket.exists(), 20, "munged's socket")
        self._spawn(["slurmctld", "-D", "-c", "-f", str(self.conf)], log / "slurmctld.out")
        self._spawn(["slurmd", "-D", "-f", str(self.conf), "-N", self.node], log / "slurmd.out")
        self._wait(lambda: self._sinfo() == "idle", 60, "the node to become idle")

    def stop(self) -> None:
        if self.jobs:  # SIGTERM to every process of the jobs, SIGKILL KillWait (10 s) later
            subprocess.run(["scancel", *self.jobs], env=self.env, capture_output=True, timeout=30)
            with contextlib.suppress(AssertionError):  # the daemons go anyway
                self._wait(lambda: all(self.state(j)[0] in FINAL_STATES | {"UNKNOWN"} for j in self.jobs), 60,
                           "the cancelled jobs to end")
        for proc in reversed(self._daemons):
            proc.terminate()
        for proc in reversed(self._daemons):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)

    def _spawn(self, cmd: list[str], out: Path) -> None:
        exe = shutil.which(cmd[0], path=SBIN_PATH)
        if exe is None:
            raise SlurmUnavailable(f"{cmd[0]} is not installed")
        with open(out, "w") as f:
            proc = subprocess.Popen([exe, *cmd[1:]], stdout=f, stderr=subprocess.STDOUT, env=self.env)
        self._daemons.append(proc)
        time.sleep(0.5)
        if proc.poll() is not None:
            raise SlurmUnavailable(f"{cmd[0]} exited at start ({proc.returncode}): {out.read_text()[-800:]}")

    @property
    def node(self) -> str:
        return socket.gethostname().split(".")[0]

    def _write_conf(self) -> None:
        mem_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        r = self.root
        # cred_expire: a requeued job may start again cred_expire + 1 s later (default 120 s); short scheduler
        # intervals so that it then starts at once
        self.conf.write_text(f"""\
ClusterName=ci
SlurmctldHost={self.node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket},cred_expire=5
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd.pid'}
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=10
MinJobAge=600
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={mem_mib} State=UNKNOWN
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    # -------------------------------------------------------------------------------------------- clients

    def run(self, cmd: list[str], timeout: float = 30) -> str:
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout

    def _sinfo(self) -> str:
        try:
            return subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=self.env, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except subprocess.TimeoutExpired:
            return ""

    def sbatch(self, args: list[str], env: dict[str, str]) -> str:
        """Submit from the repository root (the scripts find the repo through $SLURM_SUBMIT_DIR)."""
        proc = subprocess.run(["sbatch", "--parsable", *args], env={**env, "SLURM_CONF": str(self.conf),
                              "PATH": SBIN_PATH}, cwd=ROOT, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise AssertionError(f"sbatch failed ({proc.returncode}): {proc.stderr}")
        job = proc.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def state(self, job: str) -> tuple[str, dict[str, str]]:
        """(JobState, every field of `scontrol show job -o`); UNKNOWN once Slurm forgot the job."""
        proc = subprocess.run(["scontrol", "show", "job", "-o", job], env=self.env, capture_output=True, text=True,
                              timeout=10)
        fields = dict(re.findall(r"(\w+)=(\S*)", proc.stdout))
        return fields.get("JobState", "UNKNOWN"), fields

    def wait_final(self, job: str, timeout: float) -> dict[str, str]:
        """Wait until `job` (each array task, for an array) is in a final state; returns its fields."""
        self._wait(lambda: self.state(job)[0] in FINAL_STATES, timeout, f"job {job} to end")
        return self.state(job)[1]

    def _wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                logs = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((self.root / "log").glob("*"))
                               if p.is_file())
                raise AssertionError(f"timed out ({timeout:.0f} s) waiting for {what}{logs}")
            time.sleep(0.2)
