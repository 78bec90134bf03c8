"""The tensor-scheme protocol and its registry: a tensor mode is data, not branches.

A *tensor scheme* is one object per tensor mode (``none``, ``1d``, ``2d``, ``2.5d``, ``3d``, or one a
user registers) that answers every question the mode decides: its size rules and their wording,
how a head, a micro-batch and the hidden state split over its T ranks, its sub-mesh axes, which
layer replaces each plan kind, how tokens, targets and the loss are cut, and the per-rank shapes the
memory model and the planner price. Shared code asks the scheme (``mesh.tensor_mode``,
``JobLayout.mode``, ``TensorMode.parse(cfg.parallel.tensor_mode)``); it never compares a mode's name.

A scheme is a ``str`` (its config key, ``parallel.tensor_mode``): it compares equal to, hashes and
prints as that string, so configs, checkpoint metadata and metrics keep their values. The built-in
schemes live one folder each under :mod:`gridshard.tensor` (``tensor/tp1d/scheme.py`` …) and register
themselves when :mod:`gridshard` is imported; a new mode is one subclass and one
:func:`register_tensor_scheme` call (docs/architecture.md walks through one, and
``tests/test_tensor_scheme.py`` trains a mode defined inside the tests).

This module is a leaf (it imports only :mod:`gridshard.errors`) so that the job layout, the mesh and
the theory can look schemes up without importing any layer: the registry is filled from above.
Precedents: torchtitan's ``register_train_spec``, Megatron-core's ``ModuleSpec``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import LayoutError


@dataclass(frozen=True)
class DivisibilityRule:
    """``value`` (the size called ``what``) must be a multiple of ``divisor`` (called ``by``;
    a plain number such as ``"2"`` when the divisor is a constant); ``why`` says which split
    needs it, ``fix`` (optional) how to change the layout to meet it.

    ``suggest`` / ``suggest_for``: values of the size ``suggest_for`` (default ``what``) near
    the current one that fix every rule about that size and break none that held, the other
    sizes unchanged (filled in by :func:`gridshard.nn.shape_rules.model_shape_rules` for broken
    rules), so a fix never trades one broken rule for another. ``head_dim`` is not set directly:
    its fix names ``hidden`` (``alternative``: another size the fix may change instead)."""

    what: str
    value: int
    divisor: int
    by: str
    why: str
    suggest: tuple = ()
    suggest_for: str = ""
    alternative: str = ""
    fix: str = ""

    @property
    def holds(self) -> bool:
        return self.divisor > 0 and self.value % self.divisor == 0

    def message(self) -> str:
        constant = self.by == str(self.divisor)
        by = self.by if constant else f"{self.by}={self.divisor}"
        field = self.suggest_for or self.what
        fixes = [f"use {field} in {list(self.suggest)}"] if self.suggest else []
        if not constant:
            fixes.append(f"change {self.by}")
        if self.alternative:
            fixes.append(f"change {self.alternative}")
        fix = " or ".join(fixes) or f"change {field}"
        return f"{self.what}={self.value} is not divisible by {by}: {self.why}. Fix: {fix}."


class _SchemeNames(type):
    """``TensorMode.ONE_D`` and friends: a registered scheme by its constant name."""

    def __getattr__(cls, name):
        for scheme in _REGISTRY.values():
            if scheme.constant == name:
                return scheme
        raise AttributeError(f"{cls.__name__} has no attribute {name!r}")

    def __call__(cls, *args, **kwargs):
        """``TensorMode("2d")``: the registered scheme of that name; a subclass builds its one instance."""
        if cls is TensorScheme and len(args) == 1 and not kwargs:
            return tensor_scheme(args[0])
        return super().__call__(*args, **kwargs)


class TensorScheme(str, metaclass=_SchemeNames):
    """How a tensor-parallel group of T ranks splits a layer (module docstring).

    A subclass sets ``key`` (its config string), ``constant`` (``TensorMode.<constant>``) and
    ``summary`` (a few words for messages), then overrides what differs from the defaults below,
    which are a mode that keeps every weight whole on each of its T ranks. Methods that a layer
    mode answers take the layer layout's T (:meth:`layer_layout`: 2.5D answers with 2D's on q²).

    Questions and where shared code asks them:

    * sizes — :meth:`check_tensor_size`, :meth:`layer_layout`, :meth:`side`, :meth:`where`
      (config validation, the mesh, the planner's enumeration);
    * splits — :meth:`head_split`, :meth:`batch_split`, :meth:`local_kv_heads`, :meth:`kv_replication`,
      :meth:`sequence_parallel_in_effect`, :meth:`boundary_block` (job layout, pipeline, theory);
    * rules — :meth:`layout_rules`, :meth:`batch_rules` (validation, ``parallelize``);
    * runtime (defined by the folders under :mod:`gridshard.tensor`) — :meth:`mesh_dims`,
      :meth:`build_layer`, :meth:`shard_batch`, :meth:`loss`, :meth:`rank_shape` and the memory terms.
    """

    key: str = ""
    constant: str = ""
    summary: str = ""
    splits_weights: bool = True        # whether a rank holds blocks of the weights (False: replicas)

    def __new__(cls):
        if not cls.key:
            raise TypeError(f"{cls.__name__} sets no key: a tensor scheme needs its config string.")
        return str.__new__(cls, cls.key)

    def __repr__(self) -> str:
        return repr(str(self))

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __reduce__(self):
        return (tensor_scheme, (str(self),))

    @classmethod
    def parse(cls, value) -> "TensorScheme":
        """The registered scheme named by a config string (or a scheme); LayoutError for an unknown name."""
        return tensor_scheme(value)

    # ---- sizes -----------------------------------------------------------------------------------
    def check_tensor_size(self, T: int, depth: int = 1) -> None:
        """LayoutError unless T ranks (and ``depth`` layers, only 2.5D's above 1) fit the mode."""
        self.check_no_depth(depth)

    def check_no_depth(self, depth: int) -> None:
        if depth != 1:
            raise LayoutError(f"tensor_depth={depth} with tensor_mode={str(self)!r}: only 2.5D has depth layers. "
                              f"Fix: set tensor_mode to '2.5d', or tensor_depth=1.")

    def plannable(self, T: int) -> bool:
        """Whether the planner lays T ranks out in this mode (a mode that splits weights: T > 1)."""
        return T > 1

    def depth_choices(self, T: int) -> tuple:
        """The depths the planner tries for T ranks (1 unless the mode has depth layers)."""
        return (1,)

    def layer_layout(self, T: int, depth: int = 1) -> tuple:
        """(mode, tensor size) one depth layer's model is built with: (self, T) but at 2.5D."""
        return self, T

    def side(self, T: int) -> Optional[int]:
        """The grid or cube side q of T ranks; None for a mode without one."""
        return None

    def where(self, T: int) -> str:
        """How a message names the tensor group: ``on T=4``, ``on a q=2 grid``, ``on a q=2 cube``."""
        return f"on T={T}"

    # ---- splits ----------------------------------------------------------------------------------
    def sequence_parallel_in_effect(self, requested: bool, T: int) -> bool:
        """Whether sequence parallelism splits this mode's activations (1D only, T > 1)."""
        return False

    def head_split(self, T: int) -> int:
        """Ranks one head (or neuron) dimension is split over."""
        return 1

    def batch_split(self, T: int) -> int:
        """Blocks a micro-batch is split into along the batch dim."""
        return 1

    def local_kv_heads(self, kv_heads: int, T: int) -> int:
        """kv heads one rank holds."""
        return max(1, kv_heads // self.head_split(T))

    def kv_replication(self, kv_heads: int, T: int) -> int:
        """Ranks that share one kv head."""
        return 1

    def boundary_block(self, T: int, sequence_parallel: bool, micro: int, seq: int, hidden: int,
                       depth: int = 1) -> tuple:
        """One rank's block of a micro-batch's [m, s, h] hidden state at a pipeline stage boundary;
        its first dim is also the rank's rows of the stage input (tokens [m', s])."""
        return micro // self.batch_split(T), seq, hidden // self.head_split(T)

    # ---- mesh ------------------------------------------------------------------------------------
    def tensor_dims(self, T: int) -> tuple:
        """(name, size) of the device-mesh dims the T tensor ranks are laid out on, outermost first
        (flattened into one ``tensor`` dim when there are several)."""
        return (("tensor", T),)

    def weight_replica_dims(self) -> tuple:
        """Names among :meth:`tensor_dims` over which every weight is replicated and each rank sees other
        rows: they join data (× context × depth) in the gradient reduction (``mesh.data_context``)."""
        return ()

    def tensor_submesh(self, device_mesh):
        """An object built once per device mesh over :meth:`tensor_dims` (3D: the cube), or None."""
        return None

    def attach_axes(self, mesh, device_mesh, submesh, ledger) -> list:
        """Set the mode's own attributes on a :class:`gridshard.mesh.ParallelMesh` (grid axes, batch
        blocks, …); returns the extra axes whose groups the mesh owns."""
        return []

    def attach_shape_axes(self, mesh, tensor_rank: int) -> None:
        """The same attributes on a :class:`gridshard.mesh.ShapeMesh` (no process group)."""

    def logits_batch_index(self, mesh) -> int:
        """The batch block of the LM head's logits, and so of the targets (the tokens' block but at 3D)."""
        return mesh.batch_index

    # ---- layers ----------------------------------------------------------------------------------
    def build_layer(self, name: str, module, kind: str, build, tied=None):
        """The layer that replaces plain ``module`` (planned as ``kind``) on this rank, built on the meta
        device with ``build`` (:class:`gridshard.tensor.layer_build.LayerBuild`); ``tied``: the built
        embedding a vocabulary head shares its table with. Default: the module as it is."""
        return module

    def check_replicated(self, name: str, module, sequence_parallel: bool) -> None:
        """LayoutError when a module planned as ``replicate`` cannot see its whole input in this mode."""

    def token_gathers(self, mesh, sequence_parallel: bool) -> tuple:
        """((axis, dim), …): the all-gathers, in order, that turn a rank's block of the residual stream
        [b, s, h] into the whole micro-batch, the same on every tensor rank (a module laid out whole,
        an MoE block, runs on it; :meth:`gridshard.moe.layer.MoEBlock.tokens_over`). Default: none,
        every tensor rank already holds it whole."""
        return ()

    def shared_input_fusion(self, children):
        """(prepare, compute, input width) that computes layers ``children`` (built by this mode, reading one
        input) as one product (:mod:`gridshard.parallel.shared_input`), or None: each computes on its own."""
        return None

    def check_unplanned(self, name: str, module) -> None:
        """A module with parameters that the plan names no kind for: a LayoutError, since the mode must
        know how to split each weight (a mode that splits none overrides this)."""
        raise LayoutError(f"parallelize: module {name!r} ({type(module).__name__}) has parameters but the plan "
                          f"has no rule for it, so gridshard cannot know how to split it. Fix: pass "
                          f"plan=<plan>.with_rules({{{name!r}: 'column' | 'row' | 'norm' | 'replicate' ...}}).")

    # ---- cost (the planner) --------------------------------------------------------------------
    def tensor_comm(self, cfg, layout, seq: int, layers: int, first: bool, last: bool, e: int = 4) -> dict:
        """The tensor group's collectives of one micro-batch on a rank of ``layout`` (a planner layout:
        ``micro_batch``, ``tensor``, ``sequence_parallel``, ``recompute``) holding ``layers`` decoder layers
        (``first`` / ``last``: the end stages' pieces): axis name → list of
        :class:`gridshard.theory.CommVolume`, one entry per link the planner prices separately. ``e``:
        the compute dtype's element bytes: 1D prices its activation collectives in it, 2D / 2.5D / 3D
        their products' blocks, vectors and embedding (their parameters are stored in it under
        ``train.precision`` bf16); statistics and losses stay fp32 in every mode."""
        return {}

    def tensor_ring_members_per_node(self, T: int, per_node: int) -> int:
        """Members of one tensor collective's ring in each node of ``per_node`` consecutive ranks: the
        NICs a ring across nodes uses at once (:meth:`gridshard.planner.hardware.LinkCost.bus_bandwidth`).
        1 unless the mode's whole tensor group is one ring of consecutive ranks (1D)."""
        return 1

    def tensor_axis_levels(self, T: int, world: int, per_node: int):
        """axis → ``intra`` / ``inter`` for modes whose axes leave a node one by one; None: the whole
        tensor group's one link."""
        return None

    plan_title: str = ""               # a name for ``gridshard plan --explain``'s section on this mode ("" = none)
    plan_rivals: tuple = ()            # the modes that section compares it with first

    def plan_summary(self, layout, links: dict, verdict: str) -> str:
        """The rest of that section's first line: what a rank of ``layout`` holds, ``verdict``, and which of
        its axes leave a node (``links``: the step's link levels)."""
        return verdict

    def gemm_split(self, T: int) -> int:
        """By how much one rank's gate|up GEMM (2·N·h·f) is smaller than the whole (2D: one SUMMA panel
        step, q³; else T)."""
        return T

    # ---- rules -----------------------------------------------------------------------------------
    def layout_rules(self, T: int, hidden: int, heads: int, ffn: int, kv_heads: int) -> list:
        """The mode's divisibility rules on a model's dimensions, whatever its batch and sequence."""
        return []

    def batch_rules(self, T: int, sequence_parallel: bool, batch: int, seq: int) -> list:
        """The mode's rules on the tensor group's micro-batch and the sequence."""
        return []

    def depth_rules(self, T: int, depth: int, micro_batch: int) -> list:
        """Rules of the job mode (not its layer layout) on the micro-batch: 2.5D's d·q row blocks."""
        return []

    def bias_rules(self, T: int, width: int) -> list:
        """Rules on the width of a linear layer's bias (a ViT's MLP), stored in blocks by some modes."""
        return []


TensorMode = TensorScheme        # the name configs, docs and tests use for a registered scheme

_REGISTRY: dict = {}


def register_tensor_scheme(scheme: TensorScheme, replace: bool = False) -> TensorScheme:
    """Make ``scheme`` the tensor mode named ``str(scheme)`` (``parallel.tensor_mode``); returns it.
    A second scheme under a taken name is refused unless ``replace``."""
    if not isinstance(scheme, TensorScheme):
        raise TypeError(f"register_tensor_scheme: {scheme!r} is not a TensorScheme instance.")
    key = str(scheme)
    if key in _REGISTRY and not replace and type(_REGISTRY[key]) is not type(scheme):
        raise LayoutError(f"tensor_mode={key!r} is registered already ({type(_REGISTRY[key]).__name__}). Fix: "
                          f"choose another key, or pass replace=True.")
    _REGISTRY[key] = scheme
    return scheme


def unregister_tensor_scheme(key: str) -> None:
    """Remove a registered mode (tests that register their own)."""
    _REGISTRY.pop(str(key), None)


def tensor_scheme(value) -> TensorScheme:
    """The registered scheme named ``value`` (a config string or a scheme); LayoutError for an unknown name."""
    scheme = _REGISTRY.get(str(value)) if isinstance(value, str) else None
    if scheme is None:
        names = tuple(_REGISTRY)
        hints = "; ".join(f"{k!r} ({s.summary})" for k, s in _REGISTRY.items() if s.summary)
        raise LayoutError(f"tensor_mode={value!r} is unknown: it must be one of {names}. Fix: use {hints}.")
    return scheme


def tensor_schemes() -> tuple:
    """Every registered scheme, in registration order."""
    return tuple(_REGISTRY.values())
