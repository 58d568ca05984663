"""The layout of a parallel run: ParallelDims (sizes, checks) -> ParallelMesh (process groups, DeviceMesh).

World size W = pp * dp * cp * tp. Rank order, tp fastest:

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

so a tensor-parallel group is tp consecutive ranks (one NVLink island on a node), then context-parallel, then
data-parallel neighbours, and pipeline stages are the slowest dimension (they talk least).

Expert parallelism (ep, for mixture-of-experts layers) takes no ranks of its own: as in Megatron-LM and torchtitan it
is carved out of the data-parallel ranks, dp x cp flattened (dp_cp_i = dp_i * cp + cp_i), which ep must divide:

    dp_cp_i = edp_i * ep + ep_i

An ep group is ep consecutive dp_cp ranks of one (pp, tp) coordinate; each holds E / ep of a layer's experts and
the group's tokens travel between them by all-to-all. The expert-data-parallel group ("edp": dp * cp / ep ranks, one
ep_i) holds replicas of the same experts: their gradients are reduced there, the dense parameters' over dp_cp.

Nothing here is global: ``ParallelDims.build()`` returns a ``ParallelMesh`` that the model wrapping, the loss and
the optimizer take as an argument.

Initialization never hangs silently: ``init_distributed`` hosts (or joins) the rendezvous store with a timeout,
every rank announces itself, and a rank that never comes ends in a ``RendezvousError`` naming the rendezvous
address and the missing ranks. Collectives inherit the same timeout (gloo raises, NCCL's watchdog aborts). Before
any work all ranks check that they agree on the layout, the versions and the config hash (``check_agreement``).
``init_distributed`` returns the ``Rendezvous`` (the store, its address and who hosts it); the mesh keeps it, and
the step watchdog (megakern.parallel.watchdog) publishes each rank's heartbeat there.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("pp", "dp", "cp", "tp")  # slowest to fastest
GROUPS = ("dp_cp", "ep", "edp", "pp_stage")  # groups over several mesh dims
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
GRACE_S = 2.0  # how long the rendezvous host waits for the others to read the list of missing ranks


class RendezvousError(RuntimeError):
    """Ranks did not all join the rendezvous (or could not reach it) within the timeout."""


class DisagreementError(RuntimeError):
    """Ranks started with different configurations, layouts or versions."""


@dataclass(frozen=True)
class Rendezvous:
    """The rendezvous store of a run, as ``init_distributed`` made it.

    Fields:
        store: this rank's client of the TCPStore (rank 0 hosts it, or torchrun's agent); the process groups use it
            under the prefix "pg", other users under "megakern/...".
        address: "tcp://addr:port".
        host: who hosts the store, for messages: "rank 0 (node:pid)" or "torchrun's agent"; when the store stops
            answering, that is who is gone.
        attempt: torchrun's restart count ("0" outside torchrun), which scopes every key of one attempt.
    """

    store: object
    address: str
    host: str
    attempt: str = "0"


def _as_timedelta(timeout) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be seconds (int/float) or a datetime.timedelta, got {timeout!r}")
    if not seconds > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {seconds}")
    return datetime.timedelta(seconds=seconds)


# ---- the sizes -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParallelDims:
    """Sizes of each parallel dimension; ``dp=-1`` takes what is left of the world size.

    Fields:
        tp: tensor-parallel size (heads, MLP columns and the vocabulary split; sequence parallel optional).
        pp: pipeline-parallel size (stages across ranks; virtual stages per rank are a schedule choice).
        dp: data-parallel size (FSDP2 or DDP replicas); -1: world_size // (pp * cp * tp).
        cp: context-parallel size (the sequence split over ranks, ring attention).
        ep: expert-parallel size: the experts of MoE layers split over ep ranks carved out of dp x cp (ep divides
            dp * cp; see the module docstring).
        world_size: the number of ranks; None: torch.distributed's, else the WORLD_SIZE environment variable.
    """

    tp: int = 1
    pp: int = 1
    dp: int = -1
    cp: int = 1
    ep: int = 1
    world_size: int | None = None

    def __post_init__(self):
        for name in ("tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelDims: {name} must be an int >= 1, got {value!r}")
        if not isinstance(self.dp, int) or isinstance(self.dp, bool) or (self.dp < 1 and self.dp != -1):
            raise ValueError(f"ParallelDims: dp must be an int >= 1, or -1 for the rest of the world, got {self.dp!r}")
        if self.world_size is not None:
            self._check_world(self.world_size)

    # -- sizes
    def _check_world(self, world: int) -> int:
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"ParallelDims: world_size must be an int >= 1, got {world!r}")
        rest = self.pp * self.cp * self.tp
        if self.dp == -1:
            if world % rest:
                raise ValueError(f"ParallelDims: world size {world} is not divisible by pp*cp*tp = "
                                 f"{self.pp}*{self.cp}*{self.tp} = {rest}, so dp cannot be inferred")
            dp = world // rest
        elif self.dp * rest != world:
            raise ValueError(f"ParallelDims: pp*dp*cp*tp = {self.pp}*{self.dp}*{self.cp}*{self.tp} = "
                             f"{self.dp * rest} != world size {world}")
        else:
            dp = self.dp
        if (dp * self.cp) % self.ep:
            raise ValueError(f"ParallelDims: ep={self.ep} does not divide dp*cp = {dp}*{self.cp} = {dp * self.cp} "
                             f"(world size {world}): expert-parallel ranks are carved out of the data-parallel "
                             "(and context-parallel) ranks")
        return dp

    def resolve(self, world_size: int | None = None) -> ParallelDims:
        """These dims with world_size and dp filled in (from the argument, torch.distributed, or WORLD_SIZE)."""
        world = world_size if world_size is not None else self.world_size
        if world is None:
            if dist.is_available() and dist.is_initialized():
                world = dist.get_world_size()
            elif "WORLD_SIZE" in os.environ:
                world = int(os.environ["WORLD_SIZE"])
            else:
                world = self.pp * self.cp * self.tp * max(self.dp, 1)
        if self.world_size is not None and world != self.world_size:
            raise ValueError(f"ParallelDims: world_size {self.world_size} was given, but the run has {world} ranks")
        dp = self._check_world(world)
        return dataclasses.replace(self, dp=dp, world_size=world)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(pp, dp, cp, tp): the mesh's shape in MESH_DIMS order (dp must be resolved)."""
        if self.dp < 1:
            raise ValueError("ParallelDims: dp is not resolved yet (-1); call resolve() first")
        return (self.pp, self.dp, self.cp, self.tp)

    def coordinate(self, rank: int) -> dict[str, int]:
        """{"pp": .., "dp": .., "cp": .., "tp": ..} of a global rank."""
        shape = self.shape
        world = self.pp * self.dp * self.cp * self.tp
        if not 0 <= rank < world:
            raise ValueError(f"ParallelDims: rank {rank} is outside the world of {world} ranks")
        coord = {}
        for name, size in zip(reversed(MESH_DIMS), reversed(shape)):
            coord[name] = rank % size
            rank //= size
        return {name: coord[name] for name in MESH_DIMS}

    def rank_of(self, *, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The global rank at a coordinate (the inverse of ``coordinate``)."""
        for name, value, size in zip(MESH_DIMS, (pp, dp, cp, tp), self.shape):
            if not 0 <= value < size:
                raise ValueError(f"ParallelDims: {name} index {value} is outside 0..{size - 1}")
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    # -- the model
    @property
    def edp(self) -> int:
        """The expert-data-parallel size, dp * cp / ep (dp must be resolved)."""
        return self.dp * self.cp // self.ep

    def check_model(self, *, n_layer: int, n_head: int, n_kv_head: int, vocab: int, ffn_hidden: int | None = None,
                    seqlen: int | None = None, stages_per_rank: int = 1, sequence_parallel: bool = False,
                    n_experts: int = 0) -> None:
        """Raise ValueError naming the numbers when the model cannot be split this way.

        ``vocab``: the padded vocabulary (rows of the embedding); ``seqlen``: the training sequence length, when
        known (cp needs it divisible by 2*cp; sequence parallel by tp within each cp rank's share); ``n_experts``: the
        routed experts of the MoE layers (0: none), split over ep.
        """
        problems = []
        if self.ep > 1 and not n_experts:
            problems.append(f"ep={self.ep} splits the experts of MoE layers, and this model has none (n_experts=0)")
        elif n_experts % self.ep:
            problems.append(f"{n_experts} experts are not divisible by ep={self.ep}")
        if n_head % self.tp:
            problems.append(f"{n_head} attention heads are not divisible by tp={self.tp}")
        if n_kv_head % self.tp:
            problems.append(f"{n_kv_head} key/value heads are not divisible by tp={self.tp} (each rank needs whole "
                            "kv heads; use tp <= n_kv_head)")
        if ffn_hidden is not None and ffn_hidden % self.tp:
            problems.append(f"the MLP's {ffn_hidden} hidden units are not divisible by tp={self.tp}")
        if vocab % self.tp:
            problems.append(f"the padded vocabulary ({vocab}) is not divisible by tp={self.tp}")
        stages = self.pp * stages_per_rank
        if n_layer % stages:
            problems.append(f"{n_layer} layers are not divisible into pp*stages_per_rank = {self.pp}*"
                            f"{stages_per_rank} = {stages} pipeline stages")
        if seqlen is not None:
            if seqlen % (2 * self.cp):
                problems.append(f"sequence length {seqlen} is not divisible by 2*cp = {2 * self.cp} (the load-"
                                "balanced causal split gives each cp rank two chunks)")
            elif sequence_parallel and (seqlen // self.cp) % self.tp:
                problems.append(f"sequence parallel: each cp rank's {seqlen // self.cp} tokens are not divisible "
                                f"by tp={self.tp}")
        if problems:
            raise ValueError(f"ParallelDims(tp={self.tp}, pp={self.pp}, dp={self.dp}, cp={self.cp}, ep={self.ep}) "
                             "cannot split this model: " + "; ".join(problems))

    def build(self, device_type: str | None = None, timeout=DEFAULT_TIMEOUT, *, backend: str | None = None,
              agree: Mapping[str, object] | None = None, rendezvous: Rendezvous | None = None) -> ParallelMesh:
        """Initialize torch.distributed if needed (``init_distributed``), build the mesh and its groups, and check
        that every rank agrees on the layout, the versions and ``agree`` (e.g. {"config": cfg}; see
        ``check_agreement``). ``device_type``: "cuda" | "cpu" | None (cuda where available). ``rendezvous``: what
        ``init_distributed`` returned, when it was called before (the mesh keeps it: ``mesh.store``)."""
        device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        timeout = _as_timedelta(timeout)
        if not dist.is_initialized() and self.world_size in (None, 1) and rendezvous is None and (
                int(os.environ.get("WORLD_SIZE", "1")) == 1):
            return ParallelMesh(self.resolve(1), device_type, timeout, agree, None, local=True)
        if not dist.is_initialized():
            if rendezvous is not None:
                raise RuntimeError("ParallelDims.build: rendezvous= was given, but torch.distributed is not "
                                   "initialized; pass it only with the Rendezvous init_distributed returned")
            rendezvous = init_distributed(backend=backend, timeout=timeout, device_type=device_type)
        dims = self.resolve(dist.get_world_size())
        return ParallelMesh(dims, device_type, timeout, agree, rendezvous)


# ---- initialization --------------------------------------------------------------------------------------------
def _env_int(name: str, given: int | None) -> int:
    if given is not None:
        return given
    if name not in os.environ:
        raise RendezvousError(f"init_distributed: {name} is not set; run under torchrun, or pass {name.lower()}=")
    return int(os.environ[name])


def init_distributed(*, backend: str | None = None, timeout=DEFAULT_TIMEOUT, rank: int | None = None,
                     world_size: int | None = None, master_addr: str | None = None, master_port: int | None = None,
                     device_type: str | None = None) -> Rendezvous:
    """Initialize the default process group, with a rendezvous that cannot hang; returns the ``Rendezvous``.

    Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK on GPUs) from the environment unless given,
    as torchrun sets them. Rank 0 hosts a TCPStore (under torchrun's agent, the agent does); each rank announces
    itself there and waits until all ``world_size`` ranks have, for at most ``timeout``. A missing rank raises
    ``RendezvousError`` naming ``tcp://addr:port`` and the ranks that never joined; so does a rank that cannot
    reach the store. Called twice (or after someone else initialized torch.distributed), it raises.
    """
    if dist.is_initialized():
        raise RuntimeError(f"init_distributed: torch.distributed is already initialized (backend "
                           f"{dist.get_backend()}, world size {dist.get_world_size()}); initialize once and pass "
                           "the ParallelMesh around")
    timeout = _as_timedelta(timeout)
    rank, world = _env_int("RANK", rank), _env_int("WORLD_SIZE", world_size)
    addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(master_port if master_port is not None else os.environ.get("MASTER_PORT", "29500"))
    where = f"tcp://{addr}:{port}"
    if not 0 <= rank < world:
        raise RendezvousError(f"init_distributed: rank {rank} is outside the world of {world} ranks ({where})")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = backend or ("nccl" if device_type == "cuda" else "gloo")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    hosting = rank == 0 and not agent_store
    try:
        store = dist.TCPStore(addr, port, world_size=None, is_master=hosting, timeout=timeout,
                              wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001 - the store raises RuntimeError / DistStoreError / OSError variants
        if hosting:
            raise RendezvousError(f"rank 0 could not host the rendezvous at {where}: {exc}") from exc
        host = "torchrun's agent" if agent_store else "rank 0"
        raise RendezvousError(f"rank {rank} could not reach the rendezvous at {where} within "
                              f"{timeout.total_seconds():g} s: {host} (the store's host) never came up or the "
                              f"address is unreachable; missing: {'the agent' if agent_store else 'rank 0'} "
                              f"({type(exc).__name__}: {exc})") from exc
    host = _wait_for_ranks(store, rank, world, timeout, where, hosting)
    if agent_store:
        host = "torchrun's agent"
    kwargs = {}
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                            timeout=timeout, **kwargs)
    return Rendezvous(store, where, host, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _wait_for_ranks(store, rank: int, world: int, timeout: datetime.timedelta, where: str, hosting: bool) -> str:
    """Announce this rank and wait (polling, bounded by ``timeout``) until all ``world`` ranks have; returns
    "rank 0 (node:pid)", as rank 0 announced itself.

    On timeout the store's host names the missing ranks in the store and gives the others up to GRACE_S to read
    them, so every waiting rank reports the same list; the others wait GRACE_S longer than the host before
    concluding on their own, and a store that vanishes (its host gave up) ends their wait too.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"megakern/join/{attempt}"
    seconds = timeout.total_seconds()
    start = time.monotonic()
    deadline = start + seconds + (0.0 if hosting else GRACE_S)

    def fail(missing) -> RendezvousError:
        return RendezvousError(f"rendezvous at {where}: ranks {missing} of {world} did not join within {seconds:g} s "
                               f"(rank {rank} waited for them)")

    try:
        store.set(f"{prefix}/{rank}", f"{socket.gethostname()}:{os.getpid()}")
        joined = store.add(f"{prefix}/count", 1)
        delay = 0.01
        while joined < world:
            if not hosting and store.check([f"{prefix}/missing"]):
                missing = json.loads(store.get(f"{prefix}/missing"))
                store.add(f"{prefix}/acks", 1)
                raise fail(missing)
            if time.monotonic() > deadline:
                missing = [r for r in range(world) if not store.check([f"{prefix}/{r}"])]
                if hosting:
                    store.set(f"{prefix}/missing", json.dumps(missing))
                    until = time.monotonic() + GRACE_S
                    while store.add(f"{prefix}/acks", 0) < world - len(missing) - 1 and time.monotonic() < until:
                        time.sleep(0.05)
                raise fail(missing)
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
            joined = store.add(f"{prefix}/count", 0)
        return f"rank 0 ({store.get(f'{prefix}/0').decode()})"
    except RendezvousError:
        raise
    except Exception as exc:  # noqa: BLE001 - the store's errors come as several types
        raise RendezvousError(f"rendezvous at {where}: the store went away after {time.monotonic() - start:.1f} s "
                              f"while rank {rank} waited for all {world} ranks (its host, rank 0, exited or gave up; "
                              f"its own error names the missing ranks): {type(exc).__name__}: {exc}") from exc


# ---- agreement -------------------------------------------------------------------------------------------------
def config_hash(config) -> str:
    """A stable short hash of a config: dataclasses (nested), mappings, sequences and scalars, keys sorted."""

    def plain(obj):
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if isinstance(obj, Mapping):
            return {str(k): plain(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [plain(v) for v in obj]
        if isinstance(obj, (str, int, float, bool)) or obj is None:
            return obj
        return repr(obj)

    text = json.dumps(plain(config), sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def versions() -> dict[str, str]:
    """What every rank must share: megakern, torch, Python, CUDA (where torch has it)."""
    import megakern

    out = {"megakern": megakern.__version__, "torch": torch.__version__, "python": platform.python_version()}
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    return out


def check_agreement(fields: Mapping[str, str], group=None) -> None:
    """All ranks of ``group`` must hold equal ``fields``; else ``DisagreementError`` naming each field that differs
    and which ranks hold which value. A collective over ``group`` (its timeout applies)."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, dict(fields), group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(gathered)))
    problems = []
    for key in sorted({k for g in gathered for k in g}):
        by_value: dict[str, list[int]] = {}
        for r, g in zip(ranks, gathered):
            by_value.setdefault(str(g.get(key, "<missing>")), []).append(r)
        if len(by_value) > 1:
            problems.append(f"{key}: " + "; ".join(f"ranks {rs} have {v!r}" for v, rs in by_value.items()))
    if problems:
        raise DisagreementError("ranks disagree before the first step: " + " | ".join(problems))


# ---- the built mesh --------------------------------------------------------------------------------------------
class ParallelMesh:
    """Process groups of a resolved ParallelDims: a DeviceMesh with dims ("pp", "dp", "cp", "tp") and the groups
    of each, plus "dp_cp" (dp and cp flattened: where gradients are reduced and FSDP shards).

    One process with every size 1 (``ParallelDims().build()`` outside torchrun, torch.distributed not initialized)
    gets a local mesh (``local`` True): the same coordinates (all 0), no process group (the groups are None, ``mesh``
    None), so a single-process run goes through the same parallel code, whose collectives all skip groups of one.

    Attributes: dims, device (this rank's device), rank, mesh (DeviceMesh), timeout; groups ``tp_group``,
    ``cp_group``, ``dp_group``, ``pp_group``, ``dp_cp_group``, ``ep_group`` and ``edp_group`` (expert parallel and
    expert data parallel: the dp_cp ranks split as dp_cp_i = edp_i * ep + ep_i; with ep=1 ``ep_group`` is None and
    ``edp_group`` is dp_cp's) and meshes ``dp_cp_mesh``; coordinates ``tp_rank``, ``cp_rank``, ``dp_rank``,
    ``pp_rank``, ``ep_rank``, ``edp_rank``; ``rendezvous`` (``Rendezvous``, or None where torch.distributed was
    initialized elsewhere and ``build`` was not given it) and its ``store``. ``close()`` (or leaving a ``with`` block)
    destroys the groups it made, for a process that builds mesh after mesh on one default group.
    """

    def __init__(self, dims: ParallelDims, device_type: str, timeout: datetime.timedelta,
                 agree: Mapping[str, object] | None = None, rendezvous: Rendezvous | None = None, *,
                 local: bool = False):
        self.dims, self.timeout, self.device_type = dims, timeout, device_type
        self.rendezvous = rendezvous
        self.local = local
        self._store_users = 0
        self._stage_mesh = None
        if device_type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device(device_type)
        if local:  # one process, every size 1: no process group, nothing to agree on, no collective ever
            if dims.world_size != 1:
                raise ValueError(f"ParallelMesh: a local mesh is one process; these dims have {dims.world_size}")
            self.rank = self.pp_rank = self.dp_rank = self.cp_rank = self.tp_rank = 0
            self.mesh = self.dp_cp_mesh = None
            self._ep_groups = (None, None)
            return
        self.rank = dist.get_rank()
        # every rank must agree on the layout and versions before groups are split (a mismatch would hang there)
        fields = {"dims": repr(dims.shape + (dims.ep,)), **versions()}
        for name, value in (agree or {}).items():
            fields[f"hash({name})"] = config_hash(value)
        check_agreement(fields)
        ranks = torch.arange(dims.world_size).reshape(dims.shape)
        self.mesh = DeviceMesh(device_type, ranks, mesh_dim_names=MESH_DIMS)
        self.dp_cp_mesh = self.mesh["dp", "cp"]._flatten("dp_cp")
        coord = dims.coordinate(self.rank)
        self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank = (coord[n] for n in MESH_DIMS)
        self._ep_groups = self._expert_groups() if dims.ep > 1 else (None, None)

    def _expert_groups(self):
        """(ep group, edp group) of this rank: every rank makes every group, in the same order."""
        d = self.dims
        blocks = torch.arange(d.world_size).reshape(d.pp, d.edp, d.ep, d.tp)  # dp_cp_i = edp_i * ep + ep_i
        ep_ranks = blocks.permute(0, 3, 1, 2).reshape(-1, d.ep).tolist()
        edp_ranks = blocks.permute(0, 3, 2, 1).reshape(-1, d.edp).tolist()
        ep_group, _ = dist.new_subgroups_by_enumeration(ep_ranks)
        edp_group = None
        if d.edp > 1:
            edp_group, _ = dist.new_subgroups_by_enumeration(edp_ranks)
        return ep_group, edp_group

    def group(self, name: str):
        """The process group of one mesh dim ("pp" | "dp" | "cp" | "tp" | "dp_cp"), of expert parallelism ("ep":
        None when ep=1; "edp": expert data parallel, None when it has one rank), or of every rank of this pipeline
        stage ("pp_stage": dp x cp x tp, made on first use: every rank must ask for it alike); None on a local
        mesh."""
        if self.local:
            if name not in MESH_DIMS + GROUPS:
                raise ValueError(f"ParallelMesh: no dim {name!r}; dims are {MESH_DIMS + GROUPS}")
            return None
        if name == "dp_cp":
            return self.dp_cp_mesh.get_group()
        if name == "ep":
            return self._ep_groups[0]
        if name == "edp":  # expert data parallel: dp_cp itself without expert parallelism
            return self._ep_groups[1] if self.dims.ep > 1 else self.dp_cp_mesh.get_group()
        if name == "pp_stage":  # every rank of this pipeline stage (dp x cp x tp), made on first use
            if self._stage_mesh is None:
                self._stage_mesh = self.mesh["dp", "cp", "tp"]._flatten("pp_stage")
            return self._stage_mesh.get_group()
        if name not in MESH_DIMS:
            raise ValueError(f"ParallelMesh: no dim {name!r}; dims are {MESH_DIMS + GROUPS}")
        return self.mesh.get_group(name)

    tp_group = property(lambda self: self.group("tp"))
    cp_group = property(lambda self: self.group("cp"))
    dp_group = property(lambda self: self.group("dp"))
    pp_group = property(lambda self: self.group("pp"))
    dp_cp_group = property(lambda self: self.group("dp_cp"))
    ep_group = property(lambda self: self.group("ep"))
    edp_group = property(lambda self: self.group("edp"))

    @property
    def dp_cp_rank(self) -> int:
        return self.dp_rank * self.dims.cp + self.cp_rank

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert-parallel group (which E / ep experts it holds)."""
        return self.dp_cp_rank % self.dims.ep

    @property
    def edp_rank(self) -> int:
        return self.dp_cp_rank // self.dims.ep

    @property
    def store(self):
        """The rendezvous store (a TCPStore client), or None where the mesh was built without its Rendezvous."""
        return None if self.rendezvous is None else self.rendezvous.store

    def store_prefix(self, name: str) -> str:
        """A fresh key prefix in the rendezvous store for one user of it: "megakern/<name>/<attempt>/<n>", n counting
        this mesh's calls. Every rank makes the same calls in the same order (as it builds process groups), so all
        agree on the prefix without a word, and a second user (a second watchdog) never reads the first's keys."""
        if self.rendezvous is None:
            raise RuntimeError("ParallelMesh: no rendezvous store (torch.distributed was initialized outside "
                               "init_distributed and build() was not given its Rendezvous)")
        self._store_users += 1
        return f"megakern/{name}/{self.rendezvous.attempt}/{self._store_users}"

    # -- release
    def close(self) -> None:
        """Destroy the process groups this mesh made (those of the mesh dims, dp_cp, pp_stage, ep and edp; never the
        default group, which ``init_distributed`` made and ``destroy_process_group()`` ends) and drop torch's DTensor
        caches, which hold the meshes of earlier DTensors and would hand them (with their destroyed groups) to a new
        mesh of the same layout. Every rank calls it, in step, once its last collective on these groups is done; the
        mesh and everything built on it are unusable afterwards. A local mesh, or a closed one: nothing to do.
        ``with ParallelDims(...).build() as pm:`` closes on leaving the block."""
        if self.local or getattr(self, "mesh", None) is None:  # (a mesh whose __init__ failed may lack it)
            return
        groups = [self.mesh.get_group(name) for name in MESH_DIMS]
        for mesh in (getattr(self, "dp_cp_mesh", None), self._stage_mesh):
            if mesh is not None:
                groups.append(mesh.get_group())
        groups += [g for g in getattr(self, "_ep_groups", ()) if g is not None]
        self.mesh = self.dp_cp_mesh = self._stage_mesh = None
        self._ep_groups = (None, None)
        seen = {dist.group.WORLD.group_name}
        for group in groups:  # in the order they were made, the same on every rank
            if group.group_name not in seen:
                seen.add(group.group_name)
                dist.destroy_process_group(group)
        _forget_dtensor_meshes()

    def __enter__(self) -> ParallelMesh:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        d = self.dims
        ep = f", ep {self.ep_rank}/{d.ep}" if d.ep > 1 else ""
        return (f"ParallelMesh(rank {self.rank}/{d.world_size}: pp {self.pp_rank}/{d.pp}, dp {self.dp_rank}/{d.dp}, "
                f"cp {self.cp_rank}/{d.cp}, tp {self.tp_rank}/{d.tp}{ep}, device {self.device})")


def _forget_dtensor_meshes() -> None:
    """Empty torch's DTensor caches that key on (and hold) device meshes: sharding propagation (the Python cache and
    the C++ fast path), the redistribution plans and the mesh topologies. A new DeviceMesh equal to a closed one (the
    same ranks, shape and names) would otherwise be answered with the closed one, whose groups are gone ("Could not
    resolve the process group registered under the name ..."). Each is skipped where this torch has no such cache."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    caches = [getattr(propagator, "propagate_op_sharding", None),
              getattr(propagator, "_propagate_tensor_meta_cached", None)]
    try:
        from torch.distributed.tensor import _redistribute

        caches.append(getattr(_redistribute, "_gen_transform_infos", None))
        if hasattr(_redistribute, "clear_redistribute_planner_cache"):
            _redistribute.clear_redistribute_planner_cache()
    except ImportError:
        pass
    try:
        from torch.distributed.tensor._collective_utils import MeshTopoInfo

        caches.append(MeshTopoInfo.build_from_mesh)
    except ImportError:
        pass
    for cache in caches:
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
    if hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"):
        torch._C._clear_DTensor_sharding_propagator_cache()
