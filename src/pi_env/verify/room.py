"""Verify's clean room: the agent's work dir reaches verify as data, never as the verifier's tools.

Before verify the agent's work dir is moved aside, whole (`AGENT_WORKDIR`: given back after
verify, so the collected files and a later step's agent see exactly what the agent left), and
verify's work dir is built in its place: hard links to the agent's files (no data copied, no
room taken), or only the task's `outputs` when it declares them, and the task's own files. Then,
before *every* verify command (so nothing an earlier command's agent code left carries over),
pi-env's own command applies the room's rules to it, and the hidden files and an empty
logs/verifier are staged afresh over whatever stands at their paths (`prepare`). The rules, each
closing a class of forgery whatever the names involved:

- **Kinds**: only regular files, directories and symlinks; FIFOs, sockets and devices are
  removed, set-uid/set-gid bits cleared, and every dir made writable by its owner (so no rule can
  be dodged by a dir pi-env cannot delete in).
- **Links**: a symlink is kept only when it resolves (in the sandbox, fully) to a path inside the
  room that is not the verifier's, or to a path outside every place a command can write (the
  home, /tmp, /var/tmp, /dev, /proc, /sys, /run): a venv's `python -> /usr/bin/python3` works,
  a link to the reward file, a hidden file or anything of the home is gone. So a redirect the
  verifier makes into the work dir writes the work dir, never the verifier's files.
- **Code a tool trusts instead of its source**: compiled Python (`*.pyc`, `*.pyo` anywhere,
  `__pycache__`), which Python imports without checking it against a source (an unchecked-hash
  .pyc, or a .pyc with no source at all).
- **The verifier's names**: a hidden verify file's name is the verifier's in its directory: every
  entry of the agent's named as its stem or `stem.*` (a compiled extension `check.cpython-311-*.so`,
  a Node `./check` without an extension, a package dir `check/`) is removed, so however an
  import system orders candidates, the only candidate is the verifier's file; a directory
  hidden files are staged into (`tests/`) is wholly the verifier's, and so is an `__init__.py`
  beside a hidden file.
- **git**: every `.git` dir keeps its objects, refs, HEAD, index, logs, packed-refs and
  info/exclude, and its config is rewritten from an allowlist of keys that name no program
  (`GIT_CONFIG_KEYS`): filter drivers, external diff, textconv, hooks, fsmonitor, aliases,
  pagers, includes, submodule configs are never read. A `.git` *file* (a link to a git dir
  elsewhere) is removed; verify's git takes no other directory for a bare repository
  (`safe.bareRepository=explicit`, pi_env.verify.VERIFY_ENV).
- **Tool configuration**, for a task without `outputs`: what the verifier's test runners read
  from the tree by name (`TOOL_CONFIG`, whatever its content: every pytest config file name,
  conftest.py, node_modules, .npmrc, JS test runner configs ...), unless setup made it. A task
  that declares `outputs` (globs) gets only those from the agent: then nothing else reaches
  verify at all, which is the allowlist a task author controls.

`enter` (once, before the first command), `prepare` (before each command), `leave` (after the
last: the room deleted, the agent's work dir back in place). Every command pi-env runs here is an
absolute program with PATH=/usr/bin:/bin, started from the home; none runs Python.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from ..errors import InfraError
from ..results import CommandResult
from ..sandbox import SANDBOX_HOME, SANDBOX_WORKDIR, Sandbox
from ..sandbox.base import ExecResult, HostPaths, Network, RestoresHome
from ..task import PiTask

ASIDE = f"{SANDBOX_HOME}/.pi-env-verify/aside"  # what the rules moved out of the agent's work dir
VERIFIER_DIR = f"{SANDBOX_HOME}/logs/verifier"  # the reward's dir: emptied before every command
# The agent's output is the work dir and these home dirs (Harbor's /logs/agent, where Pi's
# session is too); the rest of the home is setup's (pi_env.verify.world).
AGENT_OUTPUT_DIRS = ("logs/agent",)
MAX_NOTE_NAMES = 20
MAX_SETUP_LIST_BYTES = 4 << 20  # the tool configuration setup made (paths): far more than any setup
HOME_CHANGED = 214  # run(): something outside the work dir changed since enter (stderr says what)
ROOM_FAILED = 213  # run(): the room could not be made before the command (stderr says why)
OWN_ENV = {"PATH": "/usr/bin:/bin", "BASH_ENV": "", "ENV": "", "LC_ALL": "C"}
# Places a command in the sandbox can write (besides the home): a link into one is not data.
WRITABLE = ("/tmp", "/var/tmp", "/dev", "/proc", "/sys", "/run")
# What verifier-side tools read from the tree by name (a task without `outputs`; setup's stay).
TOOL_CONFIG = (
    # pytest: every config file it looks for, whatever sections they hold, and its plugins
    "pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "pyproject.toml", "setup.cfg", "tox.ini",
    "conftest.py", ".pytest_cache", ".hypothesis", ".coveragerc",
    # Python's start-up hooks
    "sitecustomize.py", "usercustomize.py", "*.pth",
    # Node: packages resolved upwards from a hidden file, a package.json (its name, "exports" and
    # "imports" resolve a hidden file's require() before node_modules; "type" decides how it
    # loads), npm's config, JS test runners' configs
    "node_modules", "package.json", ".npmrc", "jest.config.*", "vitest.config.*", ".mocharc*", "babel.config.*", ".babelrc*",
)  # fmt: skip
# The git config keys a verify-side git keeps: none names a program or another file.
GIT_CONFIG_KEYS = (
    r"^(core\.(repositoryformatversion|filemode|symlinks|ignorecase|precomposeunicode|bare|logallrefupdates)"
    r"|extensions\.(objectformat|refstorage)|remote\..*\.(url|fetch)|branch\..*\.(remote|merge)"
    r"|user\.(name|email))$"
)
GIT_DIR_KEEP = ("HEAD", "objects", "refs", "packed-refs", "index", "logs", "shallow", "reftable", "description",
                "ORIG_HEAD", "FETCH_HEAD", "MERGE_HEAD", "info")  # fmt: skip

_ROOM = r"""set -u
mode=$1 w=$2 aside=$3 home=$4 since=$5 has_outputs=$6 verifier_dir=$7
# run: the rules, the files staged, then the verify command in its own environment, restored
verify_path=${PATH-} verify_lc=${LC_ALL-} had_lc=${LC_ALL+x}
PATH=/usr/bin:/bin LC_ALL=C
shopt -s nullglob dotglob
names=() whole=() others=() config=() own=() verifier=() stage=() command=
declare -A made=()
while IFS= read -r -d '' kind && IFS= read -r -d '' value; do
    case $kind in
        S) IFS= read -r -d '' text; stage+=("$value" "$text") ;;  # run: a file to stage (path, text)
        X) command=$value ;;        # run: the verify command, run once the room is ready
        N) names+=("$value") ;;     # a stem at the work dir's top: stem and stem.* are the verifier's
        W) whole+=("$value") ;;     # a path wholly the verifier's (a staging dir, an __init__.py)
        O) others+=("$value") ;;    # a path that is not one of the task's outputs
        C) config+=("$value") ;;    # a tool configuration name (find -name pattern)
        F) own+=("$value") ;;       # a task file that is tool configuration: staged again as the task's
        M) made[$value]=1 ;;        # tool configuration setup made (as recorded before the agent)
        V) verifier+=("$value") ;;  # an absolute path of the verifier's (links may not reach it)
    esac
done
[ -d "$w" ] && [ ! -L "$w" ] || { rm -rf -- "$w"; mkdir -p -- "$w" || exit 2; }
cd -- "$w" || exit 2
if [ "$mode" = enter ]; then rm -rf -- "$aside"; mkdir -p -- "$aside" || exit 2; fi
# run: anything outside the work dir that changed since the room was entered (an earlier
# command's agent code: a .pth, ~/node_modules, ~/.gitconfig) is named, status 214: pi-env
# puts setup's home back and runs this again. By ctime, which no command can set.
if [ "$mode" = run ] && [ -n "$since" ]; then
    # (the home itself and every dir on the way count: removing or renaming an entry changes only
    # its dir's ctime; so logs/verifier is emptied in place below, never made anew)
    changed=$(find "$home" \( -path "$w" -o -path "$aside" -o -path "$verifier_dir" -o -path "$home/logs/agent" \) \
        -prune -o -newerct "@$since" -print -quit 2>/dev/null)
    [ -z "$changed" ] || { printf 'pi-env home changed: %s\n' "${changed#"$home"/}" | head -c 600 >&2; exit 214; }
fi
bad=() i=0
# out CLASS PATH...: each path out of the room. Before the first command (enter) it is moved into
# the aside dir (a rename: no byte or inode taken) and named on stdout for put_back, as
# "<n> <class> A <name>" (printable ASCII) or "<n> <class> X <hex of its bytes>"; later
# (refresh) it is what verify's own commands left: deleted.
out() {
    local class=$1 path rel; shift
    for path; do
        [ -e "$path" ] || [ -L "$path" ] || continue
        if [ "$mode" = enter ]; then
            if mv -T -- "$path" "$aside/$i"; then
                rel=${path#"$w"/}
                if [[ $rel == *[![:print:]]* ]]; then
                    printf '%s %s X %s\n' "$i" "$class" "$(printf '%s' "$rel" | od -An -v -tx1 | tr -d ' \n')"
                else printf '%s %s A %s\n' "$i" "$class" "$rel"; fi
                i=$((i + 1))
            else bad+=("$path"); fi
        else rm -rf -- "$path" || bad+=("$path"); fi
    done
}
# A failure of the room before a later command: named on stderr with this mark, status 213.
failed() { printf 'pi-env room: %s\n' "$*" | head -c 600 >&2; exit 213; }
# what is not an output (a task that declares outputs), and the verifier's names
for path in "${others[@]}"; do out output "$w/$path"; done
for path in "${whole[@]}"; do out name "$w/$path"; done
for stem in "${names[@]}"; do out name "$w/$stem" "$w/$stem".*; done
# One walk of the rest, each entry tagged by the rule it falls under (GNU find's `,` runs every
# test on every entry): P a dir its owner cannot change, S set-id bits, K not a file, dir or link,
# L a link, C compiled Python, F tool configuration, G a .git that is not a dir, D a .git dir.
tests=( \( -type d ! -perm -u=rwx -printf 'P\0%p\0' \) , \( -type f -perm /6000 -printf 'S\0%p\0' \) ,
        \( ! -type f ! -type d ! -type l -printf 'K\0%p\0' \) , \( -type l -printf 'L\0%p\0' \) ,
        \( -name .git ! -type d -printf 'G\0%p\0' \) , \( -name .git -type d -printf 'D\0%p\0' \) ,
        \( \( -name __pycache__ -o -name '*.py[co]' \) -printf 'C\0%p\0' -prune \) )
if [ "$has_outputs" = 0 ] && [ "${#config[@]}" -gt 0 ]; then
    args=(); for name in "${config[@]}"; do args+=(-o -name "$name"); done
    tests+=( , \( \( "${args[@]:1}" \) -printf 'F\0%p\0' -prune \) )
fi
fixable=() setid=() kinds=() links=() dead=() caches=() configs=() gitfiles=() gits=()
while IFS= read -r -d '' tag && IFS= read -r -d '' path; do
    case $tag in
        P) fixable+=("$path") ;; S) setid+=("$path") ;; K) kinds+=("$path") ;;
        L) if [ -e "$path" ]; then links+=("$path"); else dead+=("$path"); fi ;;  # (a test, no fork)
        C) caches+=("$path") ;; F) configs+=("$path") ;; G) gitfiles+=("$path") ;; D) gits+=("$path") ;;
    esac
done < <(find "$w" -mindepth 1 "${tests[@]}")
[ "${#fixable[@]}" = 0 ] || chmod u+rwx -- "${fixable[@]}" 2>/dev/null
[ "${#setid[@]}" = 0 ] || chmod ug-s -- "${setid[@]}" || bad+=("set-id bits")
out kind "${kinds[@]}"
out cache "${caches[@]}"
# tool configuration, but what setup made (the task's own files of those names: staged again)
if [ "$has_outputs" = 0 ]; then
    declare -A ours=()
    for path in "${own[@]}"; do ours[$w/$path]=1; done
    for path in "${configs[@]}"; do [ -n "${made[$path]-}" ] && [ -z "${ours[$path]-}" ] || out config "$path"; done
fi
# git: objects and history stay, the config is rebuilt from keys that name no program
out git "${gitfiles[@]}"
for git in "${gits[@]}"; do
    [ -d "$git" ] && [ ! -L "$git" ] || continue
    pairs=()
    if [ -f "$git/config" ] && [ ! -L "$git/config" ] && [ -x /usr/bin/git ]; then
        while IFS= read -r -d '' pair; do pairs+=("$pair"); done \
            < <(/usr/bin/git config --file "$git/config" --null --get-regexp '__KEYS__' 2>/dev/null)
    fi
    for entry in "$git"/*; do
        case ${entry##*/} in __KEEP__) ;; *) out git "$entry" ;; esac
    done
    [ -d "$git/info" ] && for entry in "$git"/info/*; do [ "${entry##*/}" = exclude ] || out git "$entry"; done
    : > "$git/config" || bad+=("$git/config")
    for pair in "${pairs[@]}"; do
        /usr/bin/git config --file "$git/config" --add "${pair%%$'\n'*}" "${pair#*$'\n'}" || bad+=("git config")
    done
done
# links: kept only into the room (not the verifier's part) or outside every writable place
# (compared as resolved paths: the home itself may be reached through a link on unsafe-local)
# Each resolved in one realpath call per group: links that lead somewhere (realpath cannot fail
# on them), then the others, dangling or looping (resolved as far as they go, within 10 s: a link
# into itself, `a -> a/x`, never ends); a group whose answers do not line up is left out whole
# (the agent's own making), never resolved a fork per link.
resolve() {
    local n real keep; reals=()
    while IFS= read -r -d '' real; do reals+=("$real"); done < <(timeout 10 realpath -m -z -- "$@" 2>/dev/null)
    [ "${#reals[@]}" = "$#" ] || { out link "$@"; return; }
    n=0
    for link; do
        real=${reals[n]} keep=0 n=$((n + 1))
        case $real in
            "$room"/*) keep=1; for v in "${verifier[@]}"; do case $real in "$v"|"$v"/*) keep=0 ;; esac; done ;;
            ""|"$room"|/|"$home"|"$home"/*|__WRITABLE__) keep=0 ;;
            /*) keep=1 ;;
        esac
        [ "$keep" = 1 ] || out link "$link"
    done
}
if [ "${#links[@]}" -gt 0 ] || [ "${#dead[@]}" -gt 0 ]; then
    room=$(realpath -m -- "$w") home=$(realpath -m -- "$home")
    for n in "${!verifier[@]}"; do verifier[n]=$room${verifier[n]#"$w"}; done
    [ "${#links[@]}" = 0 ] || resolve "${links[@]}"
    [ "${#dead[@]}" = 0 ] || resolve "${dead[@]}"
fi
if [ "$mode" != run ]; then
    [ "${#bad[@]}" = 0 ] || { printf 'could not move or remove: %s\n' "${bad[*]}" | head -c 600 >&2; exit 3; }
    exit 0
fi
[ "${#bad[@]}" = 0 ] || failed "could not remove: ${bad[*]}"
# The task's own files the rules left out and the hidden files, as the task wrote them, over
# whatever stands at their paths; an empty verifier dir.
for ((n = 0; n < ${#stage[@]}; n += 2)); do
    path=$w/${stage[n]}
    { rm -rf -- "$path" && mkdir -p -- "${path%/*}" && printf '%s' "${stage[n + 1]}" > "$path"; } 2>/dev/null \
        || failed "could not stage ${stage[n]} (the home's blocks or inodes used up?)"
done
# (the agent's code may have made logs/ or logs/verifier unwritable: its owner can change that)
chmod u+rwx -- "${verifier_dir%/*}" 2>/dev/null; chmod -R u+rwX -- "$verifier_dir" 2>/dev/null
if [ -d "$verifier_dir" ] && [ ! -L "$verifier_dir" ]; then
    find "$verifier_dir" -mindepth 1 -delete 2>/dev/null || failed "could not empty $verifier_dir"
else
    { rm -rf -- "$verifier_dir" && mkdir -p -- "$verifier_dir"; } 2>/dev/null || failed "could not make $verifier_dir"
fi
: > "$verifier_dir/.keep" 2>/dev/null || failed "could not stage $verifier_dir/.keep (the home's blocks or inodes used up?)"
PATH=$verify_path
if [ -n "$had_lc" ]; then LC_ALL=$verify_lc; else unset LC_ALL; fi
exec /bin/bash -c "$command" < /dev/null
"""
_ROOM = (
    _ROOM.replace("__KEEP__", "|".join(GIT_DIR_KEEP))
    .replace("__KEYS__", GIT_CONFIG_KEYS)
    .replace("__WRITABLE__", "|".join(f"{place}|{place}/*" for place in WRITABLE))
)

# Put back what enter() moved, last moved first (a path moved out of a dir moved later goes back
# into it), each replacing whatever verify left at its path.
_PUT_BACK = r"""set -u
w=$1 aside=$2; shift 2
PATH=/usr/bin:/bin
for entry in "$@"; do
    n=${entry%% *} rest=${entry#* }; rest=${rest#* }; form=${rest%% *} path=${rest#* }
    if [ "$form" = X ]; then
        escaped=; for ((k = 0; k < ${#path}; k += 2)); do escaped+="\\x${path:k:2}"; done
        printf -v path '%b' "$escaped"
    fi
    path=$w/$path
    rm -rf -- "$path"; mkdir -p -- "${path%/*}"; mv -T -- "$aside/$n" "$path" || exit 1
done
"""


class RoomError(InfraError, OSError):
    """pi-env's own step could not make the room. `agents` True: what stood in its way was
    within the agent's reach (its files, its disk): a scored 0.0, never an unscored rollout."""

    def __init__(self, message: str, *, agents: bool, moved: list[str] | None = None):
        super().__init__(message)
        self.agents = agents
        self.moved = moved or []  # what enter() had moved aside when it failed (for leave)


@dataclass(frozen=True)
class Room:
    """What one verify phase's room needs to know of the task (built once, used per command)."""

    workdir: str  # as the sandbox's commands see it
    stdin: bytes
    has_outputs: bool


@dataclass
class Entered:
    """What enter() moved out of the agent's work dir (for leave), and notes for the result."""

    moved: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # When the room was entered (a sandbox that restores its home): what changed outside the work
    # dir after it, an earlier command's agent code changed (run() puts setup's home back).
    since: float | None = None


def room_for(sandbox: Sandbox, task: PiTask, setup_list: str) -> Room:
    """The rules' data for `task`: the verifier's names and paths, tool configuration setup made
    (`setup_list`, read here, before any verify command: never a file agent code could rewrite
    later), and (a task with `outputs`) what of the work dir is not an output."""
    workdir = _in_sandbox(sandbox, SANDBOX_WORKDIR).rstrip("/")
    fields: list[str] = []
    try:
        made = sandbox.read_file(setup_list, max_bytes=MAX_SETUP_LIST_BYTES)
    except FileNotFoundError:
        made = b""
    for entry in made.split(b"\0"):
        if entry:
            fields += ["M", entry.decode("utf-8", "surrogateescape")]
    names, whole = verifier_names(task)
    for name in sorted(names):
        fields += ["N", name]
    for path in sorted(whole):
        fields += ["W", path]
    for path in _not_outputs(sandbox, task, workdir):
        fields += ["O", path]
    for pattern in TOOL_CONFIG:
        fields += ["C", pattern]
    for path in task.files if task.outputs is None else ():
        if any(_config_match(part) for part in path.split("/")):
            fields += ["F", path]
    for path in sorted({*task.verify_files, *whole}):
        fields += ["V", f"{workdir}/{path}"]
    stdin = b"".join(field.encode("utf-8", "surrogateescape") + b"\0" for field in fields)
    return Room(workdir, stdin, task.outputs is not None)


def verifier_names(task: PiTask) -> tuple[set[str], set[str]]:
    """(the stem of every top-level hidden file and the top dir of every staged one: that name
    and name.* are the verifier's at the work dir's top; paths wholly the verifier's: the top
    dirs hidden files are staged into, an `__init__.py` beside a hidden file)."""
    names: set[str] = set()
    whole: set[str] = set()
    for path in task.verify_files:
        parts = path.split("/")
        names.add(_stem(parts[0]) if len(parts) == 1 else parts[0])
        if len(parts) > 1:
            whole.add(parts[0])
        whole.add("/".join([*parts[:-1], "__init__.py"]))
    whole -= set(task.verify_files)  # a hidden __init__.py is the verifier's own, staged
    return {name for name in names if name}, whole


def enter(sandbox: Sandbox, task: PiTask, room: Room) -> Entered:
    """Before the first verify command: the rules applied to the agent's work dir, what they
    exclude moved aside (for leave()). Notes name what of the agent's a verifier's tool would
    have taken for its own."""
    moved = _run(sandbox, "enter", room)
    ours = {*task.files, *task.verify_files}
    names = [_moved_name(line) for line in moved if line.split(" ", 2)[1] in ("name", "config")]
    names = [name for name in names if name not in ours]
    if not names:
        return Entered(moved)
    more = f" and {len(names) - MAX_NOTE_NAMES} more" if len(names) > MAX_NOTE_NAMES else ""
    note = "left out of verify's room (the agent's, and a verifier's tool would take it for its own): "
    return Entered(moved, [note + ", ".join(names[:MAX_NOTE_NAMES]) + more])


def refresh(sandbox: Sandbox, task: PiTask, room: Room) -> None:
    """Before a later verify command: the rules again, over what the earlier commands left
    (deleted: it is verify's, not the agent's)."""
    _run(sandbox, "refresh", room)


def leave(sandbox: Sandbox, task: PiTask, entered: Entered) -> None:
    """The hidden files gone, what enter() moved back where it was (call with nothing running):
    the work dir is the agent's again (the collected files, a later step's agent)."""
    for path in task.verify_files:
        sandbox.remove(path)
    workdir, aside = _in_sandbox(sandbox, SANDBOX_WORKDIR), _in_sandbox(sandbox, ASIDE)
    moved = list(reversed(entered.moved))
    for start in range(0, len(moved), 500):  # 500 a command, well within ARG_MAX
        outcome = _own(sandbox, ["/bin/bash", "-c", _PUT_BACK, "pi-env", workdir, aside, *moved[start : start + 500]])
        if outcome.exit_code != 0:
            raise OSError(f"could not give the agent's files back after verify: {outcome.stderr[-300:]}")
    sandbox.remove(ASIDE)


def stage(sandbox: Sandbox, task: PiTask, entered: Entered | None = None) -> None:
    """Before the first verify command: an empty logs/verifier and the hidden verify files as
    the task wrote them (later commands: run() does the same in the command's own exec). Then
    `entered` is marked: what changes outside the work dir from now on, the agent's code did."""
    sandbox.remove(VERIFIER_DIR)  # whatever the agent wrote there
    sandbox.write_file(f"{VERIFIER_DIR}/.keep", "")
    for path, text in task.verify_files.items():
        sandbox.write_file(path, text)
    if entered is not None and isinstance(sandbox, RestoresHome):
        entered.since = time.time()  # (ctime: the same kernel's clock; the command starts after it)


def restage_task_files(sandbox: Sandbox, task: PiTask) -> None:
    """The task's own files wherever the room's rules (or `outputs`) left them out: as the task
    wrote them (its data, its own configuration)."""
    for path, text in _left_out(task).items():
        sandbox.write_file(path, text)


def run(
    sandbox: Sandbox,
    task: PiTask,
    room: Room,
    entered: Entered,
    command: str,
    *,
    timeout_s: float,
    network: Network,
    env: dict[str, str],
) -> CommandResult:
    """A later verify command (call with every process killed): setup's home again if anything
    outside the work dir changed since the room was entered, the rules over what the earlier
    commands left, the task's and the hidden files staged afresh, an empty logs/verifier, then
    the command, in one exec of the sandbox. RoomError (the agent's: scored 0.0) when the room
    could not be made. What was put back is added to `entered.notes`."""
    files = {**_left_out(task), **task.verify_files}
    if any("\0" in text for text in files.values()):  # bash cannot carry a NUL: the slower way
        if entered.since is not None:
            _reset_home(sandbox, entered, "(checked in one exec only where no staged file holds a NUL)")
        refresh(sandbox, task, room)
        restage_task_files(sandbox, task)
        stage(sandbox, task, entered)
        return _result(command, sandbox.exec(command, timeout_s=timeout_s, network=network, env=env))
    fields = [field for path, text in files.items() for field in ("S", path, text)] + ["X", command]
    stdin = room.stdin + b"".join(field.encode("utf-8", "surrogateescape") + b"\0" for field in fields)

    def once() -> ExecResult:
        since = f"{entered.since:.6f}" if entered.since is not None else ""
        arguments = [*_arguments(sandbox, "run", room, since), _in_sandbox(sandbox, VERIFIER_DIR)]
        return sandbox.exec(
            ["/bin/bash", "-c", _ROOM, "pi-env", *arguments], timeout_s=timeout_s, network=network, env=env, stdin=stdin
        )

    # (the command never ran when the script ended first with its mark; a command that prints the
    # mark and exits so itself only turns its own result into a 0.0, or has setup's home put back)
    outcome = once()
    if outcome.exit_code == HOME_CHANGED and "pi-env home changed: " in outcome.stderr and entered.since is not None:
        _reset_home(sandbox, entered, outcome.stderr[outcome.stderr.index("pi-env home changed: ") + 21 :][:200])
        outcome = once()
    if outcome.exit_code in (ROOM_FAILED, HOME_CHANGED) and "pi-env " in outcome.stderr:
        raise RoomError(outcome.stderr[outcome.stderr.index("pi-env ") :].strip()[:600], agents=True)
    return _result(command, outcome)


def _result(command: str, outcome: ExecResult) -> CommandResult:
    return CommandResult(
        cmd=command,
        exit_code=outcome.exit_code,
        stdout=outcome.stdout,
        stderr=outcome.stderr,
        duration_s=round(outcome.duration_s, 4),
        timed_out=outcome.timed_out,
    )


def _reset_home(sandbox: Sandbox, entered: Entered, what: str) -> None:
    """Setup's home back for the next verify command (an earlier one's agent code changed it)."""
    if not isinstance(sandbox, RestoresHome):
        return
    aside = ASIDE.removeprefix(f"{SANDBOX_HOME}/")
    problems = sandbox.reset_home((*AGENT_OUTPUT_DIRS, aside))
    sandbox.write_file(f"{VERIFIER_DIR}/.keep", "")  # (made now, not by the command's exec after `since`)
    entered.since = time.time()
    entered.notes.append(
        f"setup's home put back before a later verify command: changed since verify began: {what.strip()}"
    )
    entered.notes += problems


def _left_out(task: PiTask) -> dict[str, str]:
    """The task's own files the room's rules (or `outputs`) leave out, to be staged as written."""
    names, whole = verifier_names(task)
    keep = _outputs_pattern(task.outputs)
    out = {}
    for path, text in task.files.items():
        parts = path.split("/")
        if (
            (keep is not None and not keep.fullmatch(path))
            or (task.outputs is None and any(_config_match(part) for part in parts))
            or any("/".join(parts[: depth + 1]) in whole for depth in range(len(parts)))
            or any(part == "__pycache__" or part.endswith((".pyc", ".pyo")) for part in parts)
            or parts[0] in names
            or _stem(parts[0]) in names
        ):
            out[path] = text
    return out


def _not_outputs(sandbox: Sandbox, task: PiTask, workdir: str) -> list[str]:
    """For a task with `outputs`: the topmost work-dir paths that are neither an output, nor
    below one, nor a dir holding one."""
    keep = _outputs_pattern(task.outputs)
    if keep is None:
        return []
    outcome = _own(sandbox, ["/usr/bin/find", workdir, "-mindepth", "1", "-printf", "%P\\0"])
    if outcome.exit_code != 0:
        raise OSError(f"could not list the work dir for the task's outputs: {outcome.stderr[-300:]}")
    paths = [path for path in outcome.stdout.split("\0") if path]
    kept = {path for path in paths if keep.fullmatch(path)}
    holding = {"/".join(path.split("/")[:depth]) for path in kept for depth in range(1, path.count("/") + 1)}
    top: list[str] = []
    for path in sorted(path for path in paths if path not in kept and path not in holding):
        if not (top and path.startswith(top[-1] + "/")):  # sorted: a dir comes before what is below it
            top.append(path)
    return top


def _moved_name(line: str) -> str:
    """The work-dir path of one of enter()'s lines ("<n> <class> A <name>" or "... X <hex>")."""
    _, _, form, name = line.split(" ", 3)
    return bytes.fromhex(name).decode("utf-8", "replace") if form == "X" else name


def _stem(name: str) -> str:
    """`check.py` -> `check`; `.hidden` -> `.hidden` (what an import names the file by)."""
    return name.rsplit(".", 1)[0] if "." in name[1:] else name


def _config_match(name: str) -> bool:
    return any(re.fullmatch(_glob_regex(pattern, path=False), name) for pattern in TOOL_CONFIG)


def _outputs_pattern(outputs: list[str] | None) -> re.Pattern[str] | None:
    """A path the outputs globs bring: matched by one, or below a dir one matches (bash globstar)."""
    if outputs is None:
        return None
    alternatives = "|".join(f"(?:{_glob_regex(glob, path=True)})" for glob in outputs) or "(?!)"
    return re.compile(rf"(?:{alternatives})(?:/.*)?")


def _glob_regex(glob: str, *, path: bool) -> str:
    out, i = "", 0
    while i < len(glob):
        if path and glob.startswith("**/", i):
            out, i = out + "(?:[^/]*/)*", i + 3
        elif path and glob.startswith("**", i):
            out, i = out + ".*", i + 2
        elif glob[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif glob[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(glob[i]), i + 1
    return out


def _arguments(sandbox: Sandbox, mode: str, room: Room, since: str = "") -> list[str]:
    return [
        mode,
        room.workdir,
        _in_sandbox(sandbox, ASIDE),
        _in_sandbox(sandbox, SANDBOX_HOME).rstrip("/"),
        since,
        "1" if room.has_outputs else "0",
    ]


def _run(sandbox: Sandbox, mode: str, room: Room) -> list[str]:
    outcome = sandbox.exec(
        ["/bin/bash", "-c", _ROOM, "pi-env", *_arguments(sandbox, mode, room), ""],
        cwd=SANDBOX_HOME,
        env=OWN_ENV,
        timeout_s=120,
        network="none",
        stdin=room.stdin,
    )
    if outcome.stdout.startswith("[... "):  # more moved than exec() keeps of stdout: leave() could not put all back
        raise RoomError("the agent's work dir holds too much that verify's room leaves out", agents=True)
    moved = [line for line in outcome.stdout.split("\n") if re.fullmatch(r"\d+ \w+ (A .+|X [0-9a-f]+)", line)]
    if outcome.exit_code == 3:
        why = f"the agent's files could not all be cleaned for verify ({outcome.stderr[-300:]})"
        raise RoomError(why, agents=True, moved=moved)
    if outcome.exit_code != 0:
        # The room's one input is the agent's tree, run after the agent: a failure or a time-out
        # here is the agent's doing (a sandbox that broke raises SandboxError instead: unscored).
        text = outcome.stderr or outcome.stdout
        why = "timed out" if outcome.timed_out else f"failed: {text[-300:]}"
        raise RoomError(f"verify's room could not be made ({mode}): {why}", agents=True, moved=moved)
    return moved


def _own(sandbox: Sandbox, argv: list[str]):
    return sandbox.exec(argv, cwd=SANDBOX_HOME, env=OWN_ENV, timeout_s=120, network="none")


def _in_sandbox(sandbox: Sandbox, path: str) -> str:
    """A sandbox path as the sandbox's commands see it (unsafe-local runs on host paths)."""
    return sandbox.host_path(path) if isinstance(sandbox, HostPaths) and path.startswith("/") else path
