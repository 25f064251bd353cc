"""Linear layers on oneDNN's prepacked weights, for CPU inference.

On a CPU, `torch.nn.functional.linear` goes to MKL: a one-token forward runs as matrix-vector products, a forward of
2-8 tokens as a small GEMM that costs up to twice as much although it reads the same weights. So a speculative round
that verifies 8 tokens costs 1.4-1.8 plain decode steps, and most of a drafter's gain is spent there. oneDNN, which
ships inside PyTorch, can reorder a weight once into the blocked layout its kernels read
(`torch.ops.mkldnn._reorder_linear_weight`, what `torch.compile`'s CPU freezing pass uses); its linear
(`torch.ops.mkldnn._linear_pointwise`) then costs about the same for 1 token as for 8, and less than MKL's for 1 on
some CPUs (not all: `choose_linear_kernels`; the figures are in docs/benchmarks.md, "CPU linear kernels", from
`benchmarks/linear_kernels.py`).

`prepack_linears(model)` swaps every fp32 `nn.Linear` of `model` for a `PrepackedLinear` in place. The module keeps
its `weight` parameter (state dicts, weight tying, `get_output_embeddings()`, pruned draft heads all see the same
tensor) and holds the packed copy beside it, so a packed model takes the weights' memory twice. The packed copy is
made again when the weight changes (`weight._version`), and autograd, other devices and other dtypes take the stock
`F.linear`, so a model that is trained after packing still trains.

Numerics: the two libraries sum in different orders, so logits differ in the last bits (about 5e-5 on this target)
and a greedy near-tie can, rarely, resolve differently. A packed target is the target whose own greedy output
speculative decoding reproduces token for token: compare speculative and plain decoding on the same model, packed or
not, as `angelspec bench` does (its `ar_stock` method times plain decoding with the stock kernels beside it).

A second library does the same for multi-token forwards only: MKL's packed GEMM (`torch.ops.mkl._mkl_reorder_linear_weight`
/ `_mkl_linear`, `cblas_sgemm_pack` / `_compute`, what `torch.compile` freezing uses for fp32 linears where MKL is
present). A weight is packed for one row count (`MKL_ROWS`); a forward of `MKL_MIN_ROWS` to `MKL_ROWS` rows is padded
with zero rows to it, every other forward (the plain decode step, the prefill) takes the stock `F.linear`. On a Xeon
where the oneDNN copy made the plain step slower, this keeps the plain step as it was and makes a verify of 6-12
tokens cost the same as one of 6 (`--linear-kernels mkl`; figures in docs/benchmarks.md, "CPU linear kernels"). A
row's result does not depend on the other rows, padding included (tested), so a speculative round verifies each
token as any other round of 6-12 tokens would.

A third is this library's own kernel, `csrc/stream_linear.cpp` (`--linear-kernels stream`): a weight is packed into
blocks of 32 output columns, and a forward of `STREAM_MIN_ROWS` to `STREAM_MAX_ROWS` rows streams each block from
memory once per tile of 12 rows, multiplying it into the tile's rows held in vector registers. A one-row forward is
bound by how fast the weights come from memory, and so is a 12-row one here, where MKL's small GEMM, packed or not,
runs compute-bound at a fraction of the CPU's peak: on the Xeon measured, a whole-block verify (9 tokens) costs 1.3
plain steps instead of 1.9 (docs/benchmarks.md, "CPU linear kernels"). Each row is computed by the same operations
whatever the other rows (bit for bit, tested), summed in chunks as MKL's blocked sum is. It is C++ compiled for the
machine on first use (`torch.utils.cpp_extension`, about 30 s, cached in torch's extensions folder; it needs a C++
compiler and ninja: `stream_available()` says whether it built, `stream_unavailable_reason()` why not).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import platform
from pathlib import Path

import torch
from torch import nn

from angelspec_hf.devices import DeviceError

__all__ = ["PrepackedLinear", "is_prepacked", "mkl_pack_available", "prepack_available", "prepack_linears",
           "stock_linears", "stream_available", "stream_unavailable_reason", "use_linear_kernels"]

KERNELS = ("auto", "prepacked", "mkl", "stream", "stock")
LIBRARIES = {"prepacked": "onednn", "mkl": "mkl", "stream": "stream"}  # `--linear-kernels` -> `PrepackedLinear.library`
AUTO_KINDS = ("prepacked", "stream")  # what `auto` times against stock (not "mkl": see `choose_linear_kernels`)
MKL_ROWS = 12  # rows an MKL-packed weight is packed for: a verify of up to 11 draft tokens and the anchor
MKL_MIN_ROWS = 6  # fewer rows take the stock kernel (as cheap as 12 padded rows, or cheaper, on the CPUs measured)
STREAM_MIN_ROWS = 3  # fewer rows (the plain decode step) take the stock kernel, which is as fast there
STREAM_MAX_ROWS = 48  # 1-4 tiles of 12 rows (the kernel's register block), each reading the weights once; more
# (long prefills, large batches) go to MKL's GEMM, which is as fast from about 48 rows on (docs/benchmarks.md)
STREAM_SOURCE = Path(__file__).parent / "csrc" / "stream_linear.cpp"


def prepack_available() -> bool:
    """Whether this PyTorch build has oneDNN's prepacked linear (x86/ARM CPU builds with MKL-DNN)."""
    return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def mkl_pack_available() -> bool:
    """Whether this PyTorch build has MKL's packed GEMM (x86 CPU builds with MKL)."""
    return bool(torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
                and hasattr(torch.ops.mkl, "_mkl_linear"))


def _build_fingerprint(source_file: Path = STREAM_SOURCE, flags_used: tuple[str, ...] = ()) -> str:
    """What a compiled kernel depends on, for its name in torch's extensions folder (which machines and checkouts
    may share): the CPU's instruction sets (it is built with -march=native), the torch it links against, and the
    source file, its path included (two checkouts never rebuild over each other's build), and any extra build flags."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    source = source_file.read_bytes() if source_file.exists() else b""
    text = "\n".join([platform.machine(), platform.processor(), flags, torch.__version__, str(source_file.resolve()),
                      *flags_used])
    return hashlib.sha256(text.encode() + source).hexdigest()[:12]


def compile_extension(prefix: str, source_file: Path, what: str, extra_cflags: tuple[str, ...] = (),
                      extra_ldflags: tuple[str, ...] = ()):
    """The compiled C++ module of `source_file` (built for this CPU on first use, about 30 s, then loaded from torch's
    extensions folder under `prefix` and `_build_fingerprint`), or the exception that building it raised (no
    compiler, no ninja, no headers, an ISA the compiler does not know). `what` names it in the one-time warning;
    `extra_cflags` / `extra_ldflags` are added to the compile / link (and to the fingerprint)."""
    try:
        import logging
        import os

        from torch.utils.cpp_extension import get_default_build_root, load

        name = f"{prefix}_{_build_fingerprint(source_file, (*extra_cflags, *extra_ldflags))}"
        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
        if not any(root.glob(f"{name}/*.so")) and not any(root.glob(f"*/{name}/*.so")):
            logging.getLogger(__name__).warning("compiling %s (%s) for this CPU: once, about 30 s", what,
                                                source_file.name)
        return load(name=name, sources=[str(source_file)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", *extra_cflags],
                    extra_ldflags=["-fopenmp", *extra_ldflags],
                    verbose=False)
    except Exception as error:  # noqa: BLE001 - reported by the caller as why the kernel is unavailable
        return error


@functools.cache
def _stream_extension():
    """The compiled `csrc/stream_linear.cpp` module (built on first use, then loaded from torch's extensions folder),
    or the exception that building it raised."""
    return compile_extension("angelspec_stream_linear", STREAM_SOURCE, "the weight-streaming kernel")


def _built_stream_extension(hint: str = ""):
    """The compiled kernel, or a RuntimeError saying why there is none (`--linear-kernels stream`, or a
    `PrepackedLinear(library="stream")` made by hand, on a machine where it does not build), ending with `hint`."""
    ext = _stream_extension()
    if isinstance(ext, Exception):
        raise RuntimeError(f"the weight-streaming kernel (angelspec_hf/csrc/stream_linear.cpp) could not be built on "
                           f"this machine ({stream_unavailable_reason()}); it needs a C++ compiler and ninja (pip "
                           f"install ninja){hint}") from ext
    return ext


@functools.cache
def _stream_linear():
    """The compiled kernel's `linear(x, packed, N, bias)`, looked up once (see `_built_stream_extension`)."""
    return _built_stream_extension().linear


def stream_available() -> bool:
    """Whether this library's weight-streaming kernel (`--linear-kernels stream`) is built for this machine (building
    it the first time: about 30 s)."""
    return not isinstance(_stream_extension(), Exception)


def build_error(ext) -> str | None:
    """What `compile_extension` returned, as why the kernel is unavailable (the first line of the error), or None
    when it built."""
    if not isinstance(ext, Exception):
        return None
    return f"{type(ext).__name__}: {(str(ext).strip().splitlines() or [''])[0]}"


def stream_unavailable_reason() -> str | None:
    """Why the weight-streaming kernel could not be built here (the first line of the error), or None when it was."""
    return build_error(_stream_extension())


def _library_available(library: str) -> bool:
    if library == "stream":
        return stream_available()
    return mkl_pack_available() if library == "mkl" else prepack_available()


def _needs_grad(linear: nn.Linear, x: torch.Tensor) -> bool:
    """Whether autograd must see this forward: the input, the weight or the bias (a frozen weight with a trained bias,
    as BitFit trains) requires a gradient. The packed kernels record no graph, so such a forward takes `F.linear`."""
    return x.requires_grad or linear.weight.requires_grad or (linear.bias is not None and linear.bias.requires_grad)


class PrepackedLinear(nn.Linear):
    """An `nn.Linear` whose inference forward reads a packed copy of its weight (see the module docstring): oneDNN's
    for every forward (`library = "onednn"`), MKL's for forwards of `MKL_MIN_ROWS` to `MKL_ROWS` rows (`"mkl"`), or
    the weight-streaming kernel's for forwards of `STREAM_MIN_ROWS` to `STREAM_MAX_ROWS` rows (`"stream"`).
    `enabled = False` makes it a plain `nn.Linear` again (`stock_linears`)."""

    library = "onednn"

    @property
    def packed_for_cpu(self) -> bool:
        """What `hardware_key` and the pruned draft head look for: a oneDNN-prepacked weight (an MKL-packed one has
        its own key, `library`)."""
        return self.library == "onednn"

    @classmethod
    def from_linear(cls, linear: nn.Linear, library: str = "onednn") -> PrepackedLinear:
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.weight, module.bias = linear.weight, linear.bias  # the same parameters, not copies
        module.enabled, module._packed, module._packed_of = True, None, None
        module.library = library
        return module

    def _packed_weight(self) -> torch.Tensor:
        w = self.weight
        version = (w.data_ptr(), w._version, self.library)
        if self._packed_of != version:
            self._packed = None  # the old copy's memory first
            with torch.no_grad():
                if self.library == "mkl":
                    self._packed = torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), MKL_ROWS)
                elif self.library == "stream":
                    self._packed = _built_stream_extension().pack(w.detach())
                else:
                    self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self._packed_of = version
        return self._packed

    def _packed_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The packed weight for a forward of `x` (packed again first if the weight changed), or None where `x` takes
        the stock kernel: packing switched off, rows that are not fp32 on the CPU or are empty, a weight elsewhere or in
        another dtype, or a forward autograd must see. On a verify's hot path (~200 calls a forward, between kernels
        that evict Python's objects from the caches), so one pass over the checks."""
        w = self.weight
        if not self.enabled or x.dtype != torch.float32 or x.device.type != "cpu" or x.numel() == 0 or (
                torch.is_grad_enabled() and _needs_grad(self, x)):
            return None
        if self._packed_of != (w.data_ptr(), w._version, self.library):
            if w.device.type != "cpu" or w.dtype != torch.float32:
                return None
            return self._packed_weight()
        return self._packed

    def __getstate__(self):  # the packed copy is an opaque oneDNN tensor: copies and pickles pack again when used
        state = super().__getstate__()
        return {**state, "_packed": None, "_packed_of": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        library = self.library
        if library != "onednn":  # a row-count window: the plain decode step leaves at once, at nn.Linear's cost
            rows = x.numel() // max(1, x.shape[-1])
            low, high = (STREAM_MIN_ROWS, STREAM_MAX_ROWS) if library == "stream" else (MKL_MIN_ROWS, MKL_ROWS)
            if not low <= rows <= high:
                return nn.functional.linear(x, self.weight, self.bias)
        packed = self._packed_for(x)
        if packed is None:
            return nn.functional.linear(x, self.weight, self.bias)
        if library == "stream":
            return _stream_linear()(x, packed, self.out_features, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        if library == "mkl":
            flat = x.reshape(rows, self.in_features)
            if rows < MKL_ROWS:
                flat = torch.cat([flat, flat.new_zeros(MKL_ROWS - rows, self.in_features)])
            out = torch.ops.mkl._mkl_linear(flat.contiguous(), packed, self.weight.detach(), bias, MKL_ROWS)
            return out[:rows].reshape(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")

    def extra_repr(self) -> str:
        return super().extra_repr() + f", prepacked={self.enabled}, library={self.library}"


def prepack_linears(model: nn.Module, library: str = "onednn") -> int:
    """Swap every fp32 CPU `nn.Linear` in `model` for a `PrepackedLinear` sharing its parameters, packed by `library`
    ("onednn", "mkl" or "stream"; linears packed already switch to it); returns how many were swapped (0 when the
    library is not available, or the model is elsewhere or in another dtype). Idempotent."""
    if library not in LIBRARIES.values():
        raise ValueError(f"library must be one of {sorted(LIBRARIES.values())}, got {library!r}")
    if not _library_available(library):
        return 0
    count = 0
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.weight.device.type == "cpu"
                    and child.weight.dtype == torch.float32):
                setattr(parent, name, PrepackedLinear.from_linear(child, library))
                count += 1
            elif isinstance(child, PrepackedLinear) and child.library != library:
                child.library, child._packed, child._packed_of = library, None, None
    return count


def is_prepacked(model: nn.Module, library: str | None = None) -> bool:
    """Whether `model` has packed linears in use (by `library`, or by either)."""
    return any(isinstance(m, PrepackedLinear) and m.enabled and library in (None, m.library) for m in model.modules())


@contextlib.contextmanager
def stock_linears(model: nn.Module, stock: bool = True):
    """Within the block, `model`'s prepacked linears use the stock `F.linear` (when `stock`; a no-op otherwise)."""
    packed = [m for m in model.modules() if isinstance(m, PrepackedLinear) and m.enabled] if stock else []
    for m in packed:
        m.enabled = False
    try:
        yield model
    finally:
        for m in packed:
            m.enabled = True


@torch.no_grad()
def time_forwards(model: nn.Module, tokens=(1, 8), context: int = 64, repeats: int = 3) -> dict[int, float]:
    """Median seconds of one forward of `model` (a causal LM) adding each of `tokens` new tokens after a `context`-token
    cache: a plain decode step (1) and a speculative verify (8)."""
    import statistics
    import time

    from transformers import DynamicCache

    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (1, context + max(tokens)), generator=torch.Generator().manual_seed(0)).to(device)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :context], cache=cache, use_cache=True)

    def once(k):
        start = time.perf_counter()
        model(input_ids=ids[:, context:context + k], cache=cache, use_cache=True)
        seconds = time.perf_counter() - start
        cache.crop(-k)
        return seconds

    once(1)  # warm-up
    return {k: statistics.median(once(k) for _ in range(repeats)) for k in tokens}


PREPACK_MARGIN = 0.05  # `choose_linear_kernels` keeps packed weights only when 5% faster


def choose_linear_kernels(target: nn.Module, *models) -> str:
    """`--linear-kernels auto`: time `target`'s plain step and 8-token verify on the stock kernels and on each packed
    library of `AUTO_KINDS` this machine has (oneDNN; the weight-streaming kernel where it builds), interleaved, each
    packed one twice, and keep the fastest for the two together; `models` (drafters) follow the target's choice. Which
    is fastest depends on the CPU (docs/benchmarks.md, "CPU linear kernels"), so a fixed default loses on some of them.
    A packed library must beat stock by `PREPACK_MARGIN`: its copies double the weights' memory, and a near tie flips
    with the noise. MKL's packed verify is not among them: on the Xeon where it makes an 8-token forward 10% cheaper,
    the batch-1 hook under its default draft-length policy ran no faster with it (four interleaved A/Bs,
    docs/benchmarks.md), so it would cost the memory for nothing; `--linear-kernels mkl` asks for it. The
    weight-streaming kernel is: there it made the 8-token forward 30% cheaper and the hook 6-12% faster under the
    default policy (three interleaved A/Bs). Returns the line the commands print."""
    modules = [m for m in (target, *models) if isinstance(m, nn.Module)]
    kinds = [kind for kind in AUTO_KINDS if _library_available(LIBRARIES[kind])]
    if kinds:
        prepack_linears(target, LIBRARIES[kinds[0]])
    if not any(isinstance(m, PrepackedLinear) for m in target.modules()):
        why = "no fp32 CPU linears" if kinds else "neither oneDNN nor the weight-streaming kernel here"
        return f"stock ({why} to prepack)"
    timed: dict[str, dict[int, float]] = {}
    for kind in kinds[:1] + ["stock"] + kinds[1:] + kinds[::-1]:  # interleaved; each library timed twice, best kept
        if kind == "stock":
            with stock_linears(target):
                timed["stock"] = time_forwards(target)
            continue
        prepack_linears(target, LIBRARIES[kind])
        _switch_packed([target], True)  # an earlier choice may have switched them off
        once = time_forwards(target)
        timed[kind] = {k: min(v, timed[kind][k]) for k, v in once.items()} if kind in timed else once
    names = {"stock": "stock", "prepacked": "prepacked", "mkl": "MKL-packed", "stream": "weight-streaming"}
    timings = "1 / 8 tokens: " + ", ".join(f"{t[1] * 1e3:.0f} / {t[8] * 1e3:.0f} ms {names[kind]}"
                                           for kind, t in timed.items())
    best = min(kinds, key=lambda kind: sum(timed[kind].values()))
    if sum(timed[best].values()) < (1 - PREPACK_MARGIN) * sum(timed["stock"].values()):
        return f"auto: {use_linear_kernels(best, *modules)}, measured faster ({timings})"
    _switch_packed(modules, False)  # stock from now on: the packed copies' memory (+540 MB) is given back
    return f"auto: stock (torch.nn.functional.linear), measured faster ({timings})"


def _switch_packed(models, enabled: bool) -> None:
    """Turn every `PrepackedLinear` of `models` on, or off for good (its packed copy freed; packed again if re-enabled)."""
    for model in models:
        for m in model.modules():
            if isinstance(m, PrepackedLinear):
                m.enabled = enabled
                if not enabled:
                    m._packed, m._packed_of = None, None


def use_linear_kernels(kind: str, *models) -> str:
    """Apply `--linear-kernels` (`KERNELS`) to `models` (anything not an `nn.Module`, such as a router, is skipped;
    with "auto" the first is the target that is timed); returns the line the commands print and record. Prepacking is
    a CPU trick: on another device "auto" keeps the stock kernels and "prepacked" raises a `DeviceError`."""
    if kind not in KERNELS:
        raise ValueError(f"linear kernels must be one of {KERNELS}, got {kind!r}")
    elsewhere = sorted({str(p.device) for m in models if isinstance(m, nn.Module)
                        for p in m.parameters() if p.device.type != "cpu"})
    if elsewhere and kind != "stock":
        if kind in LIBRARIES:
            raise DeviceError(f"--linear-kernels {kind}: packed linears run on the CPU only, and the models are on "
                              f"{', '.join(elsewhere)}; use --linear-kernels stock or auto there")
        return f"stock (torch.nn.functional.linear; prepacking is for the CPU, the models are on {', '.join(elsewhere)})"
    if kind == "auto":
        return choose_linear_kernels(*models)
    if kind == "stock":
        _switch_packed([m for m in models if isinstance(m, nn.Module)], False)  # packed by an earlier choice: undone
        return "stock (torch.nn.functional.linear)"
    modules = [m for m in models if isinstance(m, nn.Module)]
    library = LIBRARIES[kind]
    for model in modules:
        prepack_linears(model, library)
    _switch_packed(modules, True)
    count = sum(isinstance(m, PrepackedLinear) for model in modules for m in model.modules())
    if count:
        if library == "mkl":
            return f"MKL-packed for {MKL_MIN_ROWS}-{MKL_ROWS}-token forwards, stock otherwise ({count} linears)"
        if library == "stream":
            return (f"weight-streaming kernel for {STREAM_MIN_ROWS}-{STREAM_MAX_ROWS}-token forwards, stock otherwise "
                    f"({count} linears)")
        return f"oneDNN prepacked ({count} linears)"
    if library == "stream":
        _built_stream_extension("; use --linear-kernels auto or stock")  # raises where the kernel did not build
    if not _library_available(library):
        return "stock (this PyTorch has no " + ("MKL" if library == "mkl" else "oneDNN") + ")"
    return "stock (no fp32 CPU linears to prepack)"


def add_linear_kernels_argument(parser) -> None:
    parser.add_argument("--linear-kernels", choices=KERNELS, default="auto",
                        help="prepacked: the target's and drafter's fp32 CPU linears read oneDNN-prepacked weights "
                             "(a multi-token verify costs about one decode step on some CPUs; see "
                             "angelspec_hf.cpu_kernels; CPU only); mkl: forwards of 6-12 tokens (verifies) read "
                             "MKL-packed weights, the others the stock kernel; stream: forwards of 3-48 tokens run "
                             "this library's weight-streaming kernel (compiled on first use, ~30 s; a whole-block "
                             "verify at about 1.3 plain steps), the others the stock kernel; stock: torch's F.linear; "
                             "auto: on the CPU whichever of these runs the target's plain step and 8-token verify "
                             "fastest on this machine, timed at start, elsewhere stock")
