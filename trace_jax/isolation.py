"""Runs a command as untrusted code, isolated from the machine by Linux namespaces and a seccomp filter.

The command (an LLM-written capability module's validation, say) gets:
- **a filesystem of its own**: an empty in-memory root, read-only after set-up, holding only the host paths it
  was given (the Python installation, the packages, the project's own package) bound read-only where they are
  on the host, a few system folders and files, `/dev/{null,zero,random,urandom}`, its own `/proc`, and a
  size-limited in-memory working folder `/sandbox` (with `/tmp` inside it) holding copies of its input files.
  The home folder, the repository, caches and credentials are not there to read or write.
- **no network**: a network namespace of its own whose loopback is down, and internet sockets refused by the
  filter, so neither a remote host nor a server on the host's 127.0.0.1 can be reached.
- **no privileges**: it is root of a user namespace of its own (mapped to the caller's uid) with an empty
  capability bounding set and `no_new_privs`, so it cannot mount, change its root, trace other processes,
  load kernel code or regain privileges through setuid files.
- **one process**: the filter refuses fork and clone other than for threads, its own process namespace
  ends every process in it when the command ends or is killed, and rlimits cap open files and file sizes.
- **its results only as copies**: after the command ended and everything in the namespace was killed, the
  namespace's init process copies the named output files (regular files under a size limit) back to the
  caller's folder. The caller treats them as untrusted data.

Not covered: the kernel itself (a kernel exploit escapes any namespace sandbox; gVisor or a VM covers that),
and CPU time and memory, which the command caps with its own rlimits before it runs untrusted code.

It needs util-linux's `unshare`, unprivileged user namespaces and libseccomp (through `pyseccomp`).
`isolation_problem()` says what is missing; callers refuse to run untrusted code without it, never falling back
to running it unisolated. This file runs as a script inside the namespaces (its `__main__`), so it imports
nothing from the project.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import os
import pathlib
import platform
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile

PLAN = "isolation_plan.json"  # the init's instructions, in the caller's folder
WORKDIR = "/sandbox"  # the command's working folder inside
SYSTEM_PATHS = ("/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc/ld.so.cache", "/etc/localtime")
DEVICES = ("null", "zero", "random", "urandom")
HOW_TO_ENABLE = (
    "Running LLM-written code needs Linux with util-linux's `unshare` on the PATH, unprivileged user "
    "namespaces (`sysctl -w kernel.unprivileged_userns_clone=1` on Debian-style kernels, "
    "`sysctl -w user.max_user_namespaces=15000` where it is 0; on Ubuntu 24.04 also "
    "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`) and libseccomp (`apt install libseccomp2`, "
    "`pip install pyseccomp`). Inside a Docker container, run it with `--security-opt seccomp=unconfined` "
    "or use a host or VM where these are allowed."
)

# Linux constants (include/uapi/linux/mount.h, prctl.h, sched.h)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 4, 24, 38, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
CLONE_THREAD = 0x10000
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}  # syscall numbers
# statvfs flags a bind remount must keep (a user namespace may not clear them) -> their mount flags
LOCKED_FLAGS = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC}
LOCKED_FLAGS |= {os.ST_NOATIME: MS_NOATIME, os.ST_NODIRATIME: MS_NODIRATIME}


class IsolationUnavailable(RuntimeError):
    """This machine cannot isolate untrusted code; the message says what is missing and how to enable it."""


@dataclasses.dataclass(frozen=True)
class Confinement:
    """The isolated command's limits besides the namespaces (CPU time and memory: see the module docstring)."""

    timeout_s: float = 600.0  # wall clock, after which the caller kills the whole namespace
    disk_mb: int = 1024  # the in-memory working folder (files, /tmp)
    file_mb: int = 512  # any one file written, the stderr the caller keeps included
    open_files: int = 256
    output_mb: int = 512  # any one output file copied back


@dataclasses.dataclass(frozen=True)
class IsolatedRun:
    """How an isolated command ended: its exit code (128 + N for a death by signal N; None when the wall
    clock ran out and the namespace was killed), and the tail of its stderr."""

    returncode: int | None
    stderr: str

    @property
    def signal(self) -> int | None:
        """The signal that ended the command, if one did."""
        code = self.returncode
        return code - 128 if code is not None and code > 128 else None


def run_isolated(
    argv: list[str],
    folder: str | os.PathLike,
    *,
    inputs: tuple[str, ...],
    outputs: tuple[str, ...],
    readable: tuple[str, ...],
    env: dict[str, str],
    confinement: Confinement = Confinement(),
    stderr_chars: int = 4000,
) -> IsolatedRun:
    """Runs `argv` isolated (see the module docstring) in `/sandbox`, a copy of `folder`'s files `inputs`; the
    files `outputs` it leaves there are copied back into `folder` (any that exist there are removed first, so a
    file found afterwards came from this run). `readable`: the host paths it sees, read-only, besides the
    system's. Raises IsolationUnavailable where the machine cannot isolate it."""
    problem = isolation_problem()
    if problem:
        raise IsolationUnavailable(problem)
    folder = pathlib.Path(folder)
    for name in (*inputs, *outputs):
        if pathlib.PurePath(name).name != name:
            raise ValueError(f"inputs and outputs are file names in the folder, not paths: {name!r}")
    for name in outputs:
        (folder / name).unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="trace_jax_root_") as root:
        _write_plan(folder, root, argv, env, readable, inputs, outputs, confinement)
        with open(folder / "isolation_stderr.txt", "w+b") as stderr:
            process = subprocess.Popen(
                [*_unshare(), sys.executable, "-I", __file__, PLAN],
                cwd=folder,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                start_new_session=True,
            )
            try:
                returncode = process.wait(timeout=confinement.timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # unshare and the init: the namespace ends with the init
                process.wait()
                returncode = None
            stderr.seek(max(0, stderr.seek(0, os.SEEK_END) - stderr_chars))
            tail = stderr.read().decode(errors="replace")
    (folder / PLAN).unlink(missing_ok=True)
    return IsolatedRun(returncode if returncode is None or returncode >= 0 else 128 - returncode, tail)


def _write_plan(
    folder: pathlib.Path,
    root: str,
    argv: list[str],
    env: dict[str, str],
    readable: tuple[str, ...],
    inputs: tuple[str, ...],
    outputs: tuple[str, ...],
    confinement: Confinement,
) -> None:
    """The init's instructions (`PLAN` in `folder`): the root to build, what to bind, copy in and out, and run."""
    plan = {
        "root": root,
        "readable": sorted({*SYSTEM_PATHS, *readable}),
        "inputs": list(inputs),
        "outputs": list(outputs),
        "argv": argv,
        "env": env,
        "confinement": dataclasses.asdict(confinement),
    }
    (folder / PLAN).write_text(json.dumps(plan), encoding="utf-8")


def _unshare() -> list[str]:
    return [
        shutil.which("unshare") or "unshare",
        "--user",
        "--map-root-user",
        "--mount",
        "--pid",
        "--fork",
        "--kill-child",
        "--net",
        "--ipc",
        "--uts",
    ]


@functools.cache
def isolation_problem() -> str:
    """What keeps this machine from isolating untrusted code, with how to enable it; "" when nothing does.
    Probes once per process by isolating `true`."""
    if platform.system() != "Linux" or platform.machine() not in PIVOT_ROOT:
        return f"Isolation needs Linux on {', '.join(PIVOT_ROOT)}; this is {platform.system()} {platform.machine()}. "
    if not shutil.which("unshare"):
        return "util-linux's `unshare` is not on the PATH. " + HOW_TO_ENABLE
    try:
        import pyseccomp  # noqa: F401 - checked here, used inside the namespace

        pyseccomp.system_arch()
    except (ImportError, OSError, RuntimeError) as error:
        return f"libseccomp is not usable from Python ({error}). " + HOW_TO_ENABLE
    with tempfile.TemporaryDirectory(prefix="trace_jax_probe_") as folder:
        _write_plan(pathlib.Path(folder), tempfile.mkdtemp(dir=folder), ["/bin/true"], {}, (), (), (), Confinement())
        try:
            probe = subprocess.run(
                [*_unshare(), sys.executable, "-I", __file__, PLAN],
                cwd=folder,
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"Isolating a test command failed ({error}). " + HOW_TO_ENABLE
    if probe.returncode != 0:
        return f"Isolating a test command failed: {(probe.stderr or probe.stdout).strip()[-600:]} " + HOW_TO_ENABLE
    return ""


# --- inside the namespaces: the init process ---


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda s: None if s is None else s.encode()
    _check(_libc().mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {target}")


def _locked(path: str) -> int:
    """The mount flags of the mount holding `path` that a remount inside a user namespace must keep."""
    have = os.statvfs(path).f_flag
    return sum(flag for st, flag in LOCKED_FLAGS.items() if have & st)


def _bind(host: str, root: str, read_only: bool = True) -> None:
    """Binds host path `host` at the same path under `root` (a symlink, such as /lib on merged-/usr systems,
    is recreated as the same symlink)."""
    if not os.path.lexists(host):
        return
    target = root + host
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(host):
        os.symlink(os.readlink(host), target)
        return
    if os.path.isdir(host):
        os.makedirs(target, exist_ok=True)
    else:
        open(target, "ab").close()
    _mount(host, target, None, MS_BIND | MS_REC)
    if read_only:
        _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | _locked(target))


def _remount_submounts_read_only(root: str, writable: tuple[str, ...]) -> None:
    """Remounts read-only every mount under `root` but `writable` ones: a recursive bind brings a bound
    folder's own submounts, which keep the host's rw flag."""
    for line in pathlib.Path("/proc/self/mountinfo").read_text(encoding="utf-8").splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        options = line.split()[5].split(",")
        if point.startswith(root + "/") and "ro" not in options and not point.startswith(writable):
            _mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | _locked(point))


def _pivot_root(root: str) -> None:
    os.chdir(root)
    libc = _libc()
    _check(libc.syscall(PIVOT_ROOT[platform.machine()], b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "detaching the old root")
    os.chdir("/")


def _build_root(plan: dict, folder: int) -> None:
    """The command's filesystem (see the module docstring), entered with pivot_root."""
    root, confinement = plan["root"], plan["confinement"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=755")
    for path in plan["readable"]:
        _bind(path, root)
    for device in DEVICES:
        _bind(f"/dev/{device}", root, read_only=False)
    work = root + WORKDIR
    os.makedirs(work)
    _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"size={confinement['disk_mb']}m,mode=777")
    os.mkdir(work + "/tmp", 0o1777)
    os.symlink(WORKDIR + "/tmp", root + "/tmp")
    for name in plan["inputs"]:
        source = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder)
        with open(source, "rb") as src, open(f"{work}/{name}", "wb") as dst:
            shutil.copyfileobj(src, dst)
    _remount_submounts_read_only(root, (root + "/dev/", work))
    os.makedirs(root + "/proc")
    try:
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass  # some containers forbid a new /proc; the command then has none
    _pivot_root(root)
    _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | _locked("/"))
    os.chdir(WORKDIR)


def _confine(confinement: dict) -> None:
    """In the command's process before it execs: rlimits, every capability dropped for good, and the filter."""
    import pyseccomp

    mb = 2**20
    resource.setrlimit(resource.RLIMIT_NOFILE, (confinement["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (confinement["file_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    libc = _libc()
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clearing ambient capabilities")
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # until EINVAL past the last capability
        cap += 1
    deny = pyseccomp.ERRNO(1)  # EPERM
    rules = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for call in ("fork", "vfork", "ptrace", "mount", "umount2", "pivot_root", "chroot", "unshare", "setns"):
        rules.add_rule(deny, call)
    for call in ("bpf", "perf_event_open", "keyctl", "add_key", "request_key", "init_module", "finit_module"):
        rules.add_rule(deny, call)
    rules.add_rule(deny, "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, CLONE_THREAD, 0))  # a process, not a thread
    rules.add_rule(pyseccomp.ERRNO(38), "clone3")  # ENOSYS: its flags are out of the filter's sight; libc falls back
    for family in (2, 10, 16, 17):  # AF_INET, AF_INET6, AF_NETLINK, AF_PACKET
        rules.add_rule(deny, "socket", pyseccomp.Arg(0, pyseccomp.EQ, family))
    rules.load()


def _reap(pid: int) -> int:
    """Waits for `pid`, reaping the namespace's orphans meanwhile; its wait status."""
    while True:
        done, status = os.wait()
        if done == pid:
            return status


def _copy_out(name: str, folder: int, limit: int) -> None:
    """Copies output `name` from the working folder to the caller's, if it is a regular file within `limit`."""
    try:
        source = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return
    with open(source, "rb") as src:
        info = os.fstat(src.fileno())
        if not (stat.S_ISREG(info.st_mode) and info.st_size <= limit):
            return
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=folder)
        with open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)


def _init(plan: dict) -> int:
    """The namespace's pid 1: builds the root, runs the command confined, ends every process the command left,
    copies the outputs back; returns the command's exit code (128 + N for a death by signal N)."""
    import pyseccomp  # noqa: F401 - loaded (it looks libseccomp up) while the host's filesystem is in view

    folder = os.open(".", os.O_RDONLY | os.O_DIRECTORY)  # not inherited by the command
    _build_root(plan, folder)
    _check(_libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")  # the command cannot trace or open the init
    pid = os.fork()
    if pid == 0:
        try:
            _confine(plan["confinement"])
            os.execve(plan["argv"][0], plan["argv"], plan["env"])
        except BaseException as error:  # noqa: BLE001 - report anything, then leave without the init's cleanup
            print(f"isolation: could not start {plan['argv'][0]}: {error!r}", file=sys.stderr, flush=True)
        os._exit(127)
    status = _reap(pid)
    with contextlib.suppress(ProcessLookupError):  # none left
        os.kill(-1, signal.SIGKILL)  # everything else in the namespace (a setsid or daemonised child included)
    try:
        while True:
            os.wait()
    except ChildProcessError:
        pass
    for name in plan["outputs"]:
        _copy_out(name, folder, plan["confinement"]["output_mb"] * 2**20)
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as _plan:
        sys.exit(_init(json.load(_plan)))
