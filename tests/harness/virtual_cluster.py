"""Several "nodes" on one machine, and a real SLURM cluster on them, for tests (root only).

Each node is a Linux network namespace with its own address, hostname and /etc/hosts; the
filesystem stays shared, as on a cluster with a shared home. A veth pair joins every node to a
bridge in one more namespace, which also serves as the login/controller host ``p3dhead``. Nothing
touches the host's own network, and ports never clash with the host or with other instances
(every instance has its own namespaces), so the daemons keep Slurm's default ports.

Commands enter a node with ``nsenter --net`` + ``unshare --mount --uts``, bind-mount our hosts file
and set the hostname; ``ip netns exec`` is not used because it remounts /sys and slurmd then dies
(measured here: slurmd exits at start-up inside a namespace entered that way). Tear-down kills every process inside our namespaces (``ip netns pids``), whoever
started it, so job steps that slurmd re-parented are gone too, then deletes the namespaces.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

PREFIX = "p3d"  # namespaces are named p3d<pid>x<instance>-<host>; a dead <pid> marks a leftover
SUBNET = "10.213.7"  # exists only inside our namespaces
HEAD = "p3dhead"
_instances = itertools.count()
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED"}


def nodes_unavailable() -> str | None:
    """Why ``Nodes`` cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    missing = [tool for tool in ("ip", "nsenter", "unshare") if not shutil.which(tool)]
    return f"missing {', '.join(missing)} (iproute2, util-linux)" if missing else None


def cluster_unavailable() -> str | None:
    """Why ``SlurmCluster`` cannot run here, or None."""
    if reason := nodes_unavailable():
        return reason
    missing = [tool for tool in ("slurmctld", "slurmd", "munged", "sbatch") if not shutil.which(tool)]
    if missing:
        return f"missing {', '.join(missing)}: apt-get install slurmctld slurmd slurm-client munge"
    return None


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process in network namespace ``ns``, then delete it."""
    for _ in range(10):  # a dying daemon may still fork; repeat until the namespace is empty
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


def clean_leftovers() -> None:
    """Remove the namespaces, processes and temp dirs that a crashed run of this harness left."""
    def dead(name: str) -> bool:
        match = re.fullmatch(rf"{PREFIX}(\d+)x\d+-\w+", name)
        return bool(match) and not os.path.exists(f"/proc/{match.group(1)}")
    for name in filter(dead, os.listdir("/run/netns") if os.path.isdir("/run/netns") else []):
        _kill_namespace(name)
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        if dead(path.name):
            shutil.rmtree(path, ignore_errors=True)


class Nodes:
    """``count`` nodes p3dn1..p3dnN plus the login host p3dhead, as network namespaces."""

    def __init__(self, count: int):
        self.names = [f"p3dn{i}" for i in range(1, count + 1)]
        self.tag = f"{PREFIX}{os.getpid()}x{next(_instances)}"
        self.addresses = {HEAD: f"{SUBNET}.254", **{n: f"{SUBNET}.{i}" for i, n in enumerate(self.names, 1)}}
        self.workdir: Path | None = None  # the hosts file, SlurmCluster's files; made on entering
        self.procs: list[subprocess.Popen] = []
        self.namespaces: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def __enter__(self) -> "Nodes":
        clean_leftovers()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _create(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        self.hosts = self.workdir / "hosts"
        head = self.ns(HEAD)
        self.namespaces.append(head)
        _sh("ip", "netns", "add", head)
        _sh("ip", "-n", head, "link", "set", "lo", "up")
        _sh("ip", "-n", head, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", head, "addr", "add", f"{self.addresses[HEAD]}/24", "dev", "br0")
        _sh("ip", "-n", head, "link", "set", "br0", "up")
        for i, name in enumerate(self.names, 1):
            ns = self.ns(name)
            self.namespaces.append(ns)
            _sh("ip", "netns", "add", ns)
            # Created inside the head namespace, so the veth names never meet the host's.
            _sh("ip", "-n", head, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "-n", head, "link", "set", f"v{i}", "master", "br0", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.addresses[name]}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        lines = ["127.0.0.1 localhost", *(f"{addr} {host}" for host, addr in self.addresses.items())]
        self.hosts.write_text("\n".join(lines) + "\n")

    def command(self, host: str, cmd: list[str]) -> list[str]:
        """``cmd`` as run on ``host``: its network, its hostname, our /etc/hosts."""
        enter = 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"'
        return ["nsenter", f"--net=/run/netns/{self.ns(host)}", "unshare", "--mount", "--uts",
                "--propagation", "private", "sh", "-c", enter, str(self.hosts), host, *cmd]

    def popen(self, host: str, cmd: list[str], **kwargs) -> subprocess.Popen:
        # Its own process group: close() can kill the command together with its children.
        proc = subprocess.Popen(self.command(host, cmd), start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, host: str, cmd: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        proc = self.popen(host, cmd, **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True,
                                        **kwargs})
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        finally:
            if proc.poll() is not None:
                self.procs.remove(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
        for ns in reversed(self.namespaces):
            _kill_namespace(ns)
        self.namespaces.clear()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.close()


SLURM_CONF = """\
ClusterName=p3d
SlurmctldHost={head}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge/socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
MpiDefault=none
SlurmdParameters=config_overrides
ReturnToService=2
# Keep finished jobs visible to `scontrol show job` (there is no sacct without slurmdbd).
MinJobAge=3600
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/run/slurmctld.pid
SlurmdPidFile={dir}/run/slurmd.%n.pid
NodeName={nodes} CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """munged + slurmctld on p3dhead, ``slurmd -N p3dnI`` on each node; all state in a temp dir."""

    def __init__(self, count: int = 2, cpus: int = 2, ready_timeout: float = 60):
        self.nodes = Nodes(count)
        self.cpus, self.ready_timeout = cpus, ready_timeout
        self.daemons: dict[str, subprocess.Popen] = {}

    @property
    def dir(self) -> Path:
        return self.nodes.workdir

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    def env(self, base: dict | None = None) -> dict:
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    def __enter__(self) -> "SlurmCluster":
        try:
            self.nodes.__enter__()
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        for sub in ("state", "run", "log", "munge", *(f"spool/{name}" for name in self.nodes.names)):
            (self.dir / sub).mkdir(parents=True)
        for path in (self.dir, self.dir / "munge"):
            path.chmod(0o755)  # munged wants the directories above its socket searchable by all
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))  # a fresh key: no clash with a system munge
        key.chmod(0o600)
        nodes = f"p3dn[1-{len(self.nodes.names)}]"
        self.conf.write_text(SLURM_CONF.format(head=HEAD, dir=self.dir, nodes=nodes, cpus=self.cpus))
        m = self.dir / "munge"
        self._daemon(HEAD, ["munged", "--foreground", "--force", f"--socket={m}/socket", f"--key-file={key}",
                            f"--pid-file={self.dir}/run/munged.pid", f"--seed-file={m}/seed"])
        self._wait(lambda: (m / "socket").exists(), "munged socket")
        self._daemon(HEAD, ["slurmctld", "-D", "-i"])
        for name in self.nodes.names:
            self._daemon(name, ["slurmd", "-D", "-N", name])
        self.wait_idle()

    def wait_idle(self) -> None:
        """Until every node is idle (no job on it, none still completing); raises after ``ready_timeout``."""
        def idle() -> bool:
            out = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.split()
            return len(out) == len(self.nodes.names) and all(s == "idle" for s in out)
        self._wait(idle, "all nodes idle")

    def _daemon(self, host: str, cmd: list[str]) -> None:
        """Start a daemon in the foreground, so that it is our child and cannot escape tear-down.

        In the foreground the daemons log to stderr: no log file settings, one log per daemon."""
        with open(self.dir / "log" / f"{cmd[0]}.{host}.stdout", "w") as log:
            proc = self.nodes.popen(host, cmd, env=self.env(), stdout=log, stderr=subprocess.STDOUT)
        self.daemons[f"{cmd[0]} on {host}"] = proc

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while not ready():
            dead = [name for name, proc in self.daemons.items() if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"SLURM cluster: no {what} (exited: {dead})\n{self.logs()}")
            time.sleep(0.5)

    def run(self, cmd: list[str], check: bool = True, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """``cmd`` on the login host, with SLURM_CONF set."""
        kwargs["env"] = self.env(kwargs.get("env"))
        result = self.nodes.run(HEAD, cmd, timeout=timeout, **kwargs)
        if check and result.returncode:
            raise RuntimeError(f"{cmd} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return result

    def sbatch(self, script: Path, *options: str, **kwargs) -> str:
        return self.run(["sbatch", "--parsable", *options, str(script)], **kwargs).stdout.strip().split(";")[0]

    def squeue(self) -> str:
        return self.run(["squeue"]).stdout
    def scontrol(self, *args: str) -> str:
        return self.run(["scontrol", *args]).stdout

    def job_state(self, job_id: str) -> str:
        return re.search(r"JobState=(\S+)", self.scontrol("show", "job", job_id)).group(1)

    def wait_for_job(self, job_id: str, timeout: float = 600) -> str:
        """Poll until the job ends; its final state (COMPLETED, FAILED, ...). Cancels it on timeout."""
        deadline = time.monotonic() + timeout
        while (state := self.job_state(job_id)) not in TERMINAL:
            if time.monotonic() > deadline:
                self.run(["scancel", job_id], check=False)
                return f"TIMEOUT_WAITING({state})"
            time.sleep(1)
        return state

    def logs(self, tail: int = 3000) -> str:
        """The daemons' logs, for a failing test's report."""
        parts = []
        for path in sorted((self.dir / "log").glob("*")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def close(self) -> None:
        # Ask the daemons to stop, so slurmd can end its job steps, then kill what is left. They run in
        # the foreground, so each one's pid is our child's (what their pid files say, without the risk
        # of a stale file).
        for proc in self.daemons.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 5
        while any(p.poll() is None for p in self.daemons.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.nodes.close()  # also removes self.dir

    def __exit__(self, *exc) -> None:
        self.close()
