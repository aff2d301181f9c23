"""Will the training fit? Per-GPU memory estimates, the fit check, and `--technique auto`.

Everything here is arithmetic on a few numbers of the model (`ModelShape`) and of the run
(`TrainingSetup`); nothing imports torch until a shape has to be read from a model config.
Sizes are in decimal gigabytes (1 GB = 1e9 bytes) per GPU.

Formulas (N: parameters, W: world size = `gpus`, b: per-device batch, s: max_length, h: hidden
size, L: layers, V: vocabulary, a: attention heads, I: MLP intermediate size, k: experts a
token is routed to, 1 for a dense model; cb: bytes of the compute dtype, 2 for bf16, 4 for
fp32):

- **Model states, full fine-tuning**: 16 bytes per parameter, split (params, grads, optimizer).
  DeepSpeed in bf16 keeps bf16 params and grads and fp32 master weights plus Adam's two
  moments: 2 + 2 + 12 (the ZeRO paper's mixed-precision Adam). Everywhere else the fp32 weights
  are the master copy (DDP under the Trainer's bf16 autocast, FSDP's `MixedPrecisionPolicy`,
  plain fp32): 4 + 4 + 8.
- **LoRA**: the frozen base costs only its weights, in the dtype it is loaded in (2 bytes per
  parameter in bf16, 4 in fp32), with no grads and no optimizer state; the adapters (r x (in +
  out) per targeted projection per layer) are trained in fp32: 4 + 4 + 8 per adapter parameter.
- **Sharding**: DDP replicates everything and adds a gradient bucket copy (4 bytes per trained
  parameter: the all-reduce buckets are not views of the grads). ZeRO-1 divides the optimizer
  states by W, ZeRO-2 also the grads, ZeRO-3 also the params (frozen ones included). FSDP full
  shard divides all three by W (its `reshard_after_forward=false` keeps the whole model
  gathered between forward and backward). CPU offload moves what it offloads to host RAM
  (reported, not checked). Each technique config holds its own part of this
  (`memory_per_gpu`: a `Replica` in, `States` out), so a registered technique is estimated too.
- **Gathered working set** (FSDP and ZeRO-3): the units being computed stay whole on the GPU:
  two decoder layers (the one running and the one prefetched) and the output head, in the
  compute dtype, plus their unsharded grads when they are trained.
- **Activations**: per layer and token, (18 h + 8 k I) x cb / 2 bytes: the attention's inputs,
  q/k/v and their rotary copies, its output and the norms' inputs (about 18 h in 16-bit), and a
  gated MLP's four I-wide tensors per routed expert (8 k I). Korthikanti et al. (2022) count
  34 h for a GeLU MLP with I = 4 h; a gated MLP keeps more. Eager attention (gpt-oss) also
  keeps the a x s x s scores: 5 x cb / 2 bytes each per layer (Korthikanti's 5 a s^2 b). Total:
  b s L (18 h + 8 k I) cb / 2 + L x scores. With activation checkpointing only each layer's
  input stays (b s h cb per layer), plus one layer recomputed in full during backward.
- **Logits**: b s V x (cb + 8) bytes: the logits, their fp32 log-softmax for the loss, and its
  gradient (a 200k vocabulary makes this the largest activation).
- **Reserve**: 2 GB per GPU for the CUDA context, NCCL and cuBLAS workspaces and allocator
  fragmentation.

Available memory per GPU: `--gpu-memory-gb` when given, else the GPUs this node has
(`nvidia-smi --query-gpu=name,memory.total`), else `GPU_MEMORY_GB` for the config's `gpu_type`.
CPU ranks, or a GPU type neither present nor in the table, are not checked: the estimate is
reported and nothing is refused.

`--technique auto` tries, in order: DDP; DeepSpeed ZeRO-2; FSDP full shard (ZeRO-3's layout:
the same estimate); FSDP with CPU offload; and takes the first that fits (`choose_technique`).
"""

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from trainflow.launch.plan import gpu_name_matches, query_gpus
from trainflow.strategies.config import DDPConfig, DeepSpeedConfig, FSDPConfig, Precision, Technique
from trainflow.strategies.footprint import Replica

GB = 1e9
# Memory per GPU by type, in GB as sold (conservative: an "80 GB" H100 reports 85.5 GB).
GPU_MEMORY_GB: dict[str, float] = {"H100": 80, "H200": 141, "A100": 80, "A10": 24, "L4": 24}
RESERVE_GB = 2.0


class MemoryFitError(ValueError):
    """The run would not fit the GPUs' memory (raised before any rank starts)."""


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a causal LM the estimate needs."""

    name: str
    params: int
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tied_embeddings: bool
    num_experts: int = 0  # 0: a dense MLP
    experts_per_token: int = 0
    eager_attention: bool = False  # the attention keeps its a x s x s scores
    active_params: int | None = None
    source: str = "table"

    @property
    def embedding_params(self) -> int:
        """Input embedding and output head (one matrix when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    @property
    def layer_params(self) -> float:
        """Parameters of one decoder layer (everything but the embeddings, spread evenly)."""
        return (self.params - self.embedding_params) / self.num_layers

    @property
    def routed(self) -> int:
        """MLPs a token passes through per layer (its experts; 1 for a dense model)."""
        return self.experts_per_token or 1

    def describe(self) -> str:
        moe = ""
        if self.num_experts:
            active = f", {_count(self.active_params)} active" if self.active_params else ""
            moe = f", MoE {self.experts_per_token} of {self.num_experts} experts{active}"
        return f"{self.name} ({_count(self.params)} params{moe}; {self.source})"


def _count(n: float) -> str:
    """1.24e9 -> '1.24B', 2.1e6 -> '2.10M'."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _gpt_oss(name: str, layers: int, experts: int, params: float, active: float) -> ModelShape:
    return ModelShape(
        name=name,
        params=int(params),
        hidden_size=2880,
        num_layers=layers,
        vocab_size=201088,
        num_heads=64,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=2880,
        tied_embeddings=False,
        num_experts=experts,
        experts_per_token=4,
        eager_attention=True,  # transformers' gpt-oss has no SDPA path (attention sinks)
        active_params=int(active),
    )


_LLAMA_3_2_1B = ModelShape(
    name="meta-llama/Llama-3.2-1B-Instruct",
    params=1_235_814_400,
    hidden_size=2048,
    num_layers=16,
    vocab_size=128256,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    intermediate_size=8192,
    tied_embeddings=True,
)

# The shipped presets' models, so their estimate needs no network (numbers from their
# config.json; parameter counts as their model cards give them, dequantized to bf16).
KNOWN_MODELS: dict[str, ModelShape] = {
    "openai/gpt-oss-20b": _gpt_oss("openai/gpt-oss-20b", 24, 32, 20.91e9, 3.61e9),
    "openai/gpt-oss-120b": _gpt_oss("openai/gpt-oss-120b", 36, 128, 116.83e9, 5.13e9),
    "meta-llama/Llama-3.2-1B-Instruct": _LLAMA_3_2_1B,
    "meta-llama/Llama-3.2-1B": replace(_LLAMA_3_2_1B, name="meta-llama/Llama-3.2-1B"),
}


def shape_from_config(name: str, config: Any, source: str) -> ModelShape:
    """The shape of a transformers model config; parameters counted on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    experts = int(getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0))
    per_token = int(getattr(config, "num_experts_per_tok", 0) or 0)
    active = None
    if experts and per_token:
        expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        active = params - expert_params + expert_params * per_token // experts
    heads = int(config.num_attention_heads)
    hidden = int(config.hidden_size)
    return ModelShape(
        name=name,
        params=params,
        hidden_size=hidden,
        num_layers=int(config.num_hidden_layers),
        vocab_size=int(config.vocab_size),
        num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
        intermediate_size=int(config.intermediate_size),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        num_experts=experts,
        experts_per_token=per_token,
        eager_attention=model.config._attn_implementation == "eager",
        active_params=active,
        source=source,
    )


def model_shape(name: str, tokenizer: str | None = None) -> ModelShape:
    """The shape of model `name`: the table for known Hub models, else its config.

    Tiny architectures are built from their config with `tokenizer`'s vocabulary; another Hub
    id or local directory needs its `config.json` (`transformers.AutoConfig`: network for a Hub
    id not cached yet).

    Raises:
        MemoryFitError: the config cannot be read (no network, unknown id).
    """
    if name in KNOWN_MODELS:
        return KNOWN_MODELS[name]
    if (name, tokenizer) in _read_shapes:
        return _read_shapes[(name, tokenizer)]
    shape = _read_shape(name, tokenizer)
    remember_shape(name, tokenizer, shape)
    return shape


# Shapes read in this process, or handed to it by the process that read them (a launch's
# standby agent, which has transformers loaded: `remember_shape`).
_read_shapes: dict[tuple[str, str | None], ModelShape] = {}


def remember_shape(name: str, tokenizer: str | None, shape: ModelShape | dict[str, Any]) -> None:
    """`model_shape(name, tokenizer)` gives `shape` from now on in this process."""
    _read_shapes[(name, tokenizer)] = (
        shape if isinstance(shape, ModelShape) else ModelShape(**shape)
    )


def _read_shape(name: str, tokenizer: str | None) -> ModelShape:
    from trainflow.models.causal_lm import is_tiny

    if is_tiny(name):
        from trainflow.data.tokenizer import load_tokenizer
        from trainflow.models.causal_lm import model_config

        if tokenizer is None:
            raise ValueError(f"the tiny model {name} needs a tokenizer for its vocabulary")
        return shape_from_config(name, model_config(name, load_tokenizer(tokenizer)), "config")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise MemoryFitError(
            f"cannot size model {name!r} for the memory estimate: its config.json is not "
            f"readable ({exc}); a Hub id needs network (or the Hugging Face cache)"
        ) from exc
    return shape_from_config(name, config, "config.json")


@dataclass(frozen=True)
class TrainingSetup:
    """What is trained and how, as far as memory goes."""

    micro_batch_size: int
    seq_len: int
    world_size: int
    precision: Precision = "fp32"  # compute precision
    weights_dtype: Precision = "fp32"  # what a frozen LoRA base is loaded in
    lora_rank: int | None = None  # None: full fine-tuning
    lora_targets: tuple[str, ...] = ()
    activation_checkpointing: bool = False

    @property
    def compute_bytes(self) -> int:
        return 2 if self.precision == "bf16" else 4


def lora_params(shape: ModelShape, rank: int, targets: Iterable[str]) -> int:
    """Adapter parameters: r x (in + out) for each targeted projection of each layer.

    Attention projections (q/k/v/o_proj) and a dense gated MLP (gate/up/down_proj) have known
    sizes; any other name is counted as an h -> h projection.
    """
    h, q, kv, i = (
        shape.hidden_size,
        shape.num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
        shape.intermediate_size,
    )
    sizes = {
        "q_proj": h + q,
        "k_proj": h + kv,
        "v_proj": h + kv,
        "o_proj": q + h,
        "gate_proj": h + i,
        "up_proj": h + i,
        "down_proj": i + h,
    }
    return shape.num_layers * sum(rank * sizes.get(t, 2 * h) for t in targets)


@dataclass(frozen=True)
class Estimate:
    """Bytes per GPU by component, and what is kept in host RAM per GPU."""

    technique: str
    params: float
    grads: float
    optimizer: float
    buffers: float  # DDP's gradient buckets, or FSDP/ZeRO-3's gathered units
    activations: float
    logits: float
    reserve: float = RESERVE_GB * GB
    host: float = 0.0
    notes: tuple[str, ...] = field(default=())

    @property
    def total(self) -> float:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.buffers
            + self.activations
            + self.logits
            + self.reserve
        )

    @property
    def total_gb(self) -> float:
        return self.total / GB

    def parts(self) -> dict[str, float]:
        """Each component in GB."""
        return {
            "params": self.params / GB,
            "grads": self.grads / GB,
            "optimizer": self.optimizer / GB,
            "buffers": self.buffers / GB,
            "activations": self.activations / GB,
            "logits": self.logits / GB,
            "reserve": self.reserve / GB,
        }

    def breakdown(self) -> str:
        """`params 2.5 + grads 2.5 + ... = 26.2 GB per GPU` (and host RAM when offloading)."""
        terms = " + ".join(f"{k} {v:.1f}" for k, v in self.parts().items())
        text = f"{terms} = {self.total_gb:.1f} GB per GPU"
        if self.host:
            text += f" (+ {self.host / GB:.1f} GB of host RAM per GPU)"
        return text


def _activations(shape: ModelShape, setup: TrainingSetup) -> float:
    b, s, cb = setup.micro_batch_size, setup.seq_len, setup.compute_bytes
    h, i, k = shape.hidden_size, shape.intermediate_size, shape.routed
    per_layer = b * s * (18 * h + 8 * k * i) * cb / 2
    if shape.eager_attention:
        per_layer += 5 * shape.num_heads * s * s * b * cb / 2
    if setup.activation_checkpointing:
        return shape.num_layers * b * s * h * cb + per_layer
    return shape.num_layers * per_layer


def replica(shape: ModelShape, setup: TrainingSetup) -> Replica:
    """One whole copy of the model states of training `shape` as `setup` says, unsharded."""
    if setup.lora_rank is None:
        trained, frozen, frozen_bytes = float(shape.params), 0.0, 0
    else:
        trained = float(lora_params(shape, setup.lora_rank, setup.lora_targets))
        frozen = shape.params - trained
        frozen_bytes = 2 if setup.weights_dtype == "bf16" else 4
    gathered = 2 * shape.layer_params + shape.vocab_size * shape.hidden_size
    with_grads = 1 + trained / shape.params
    return Replica(
        trained=trained,
        frozen_weights=frozen * frozen_bytes,
        world_size=setup.world_size,
        precision=setup.precision,
        layer_units=gathered * setup.compute_bytes * with_grads,
        whole_model=float(shape.params) * setup.compute_bytes * with_grads,
    )


def estimate(shape: ModelShape, setup: TrainingSetup, technique: Technique) -> Estimate:
    """Memory per GPU of training `shape` as `setup` says with `technique` (see the module)."""
    states = technique.memory_per_gpu(replica(shape, setup))
    b, s, v = setup.micro_batch_size, setup.seq_len, shape.vocab_size
    return Estimate(
        technique=technique.describe(),
        params=states.params,
        grads=states.grads,
        optimizer=states.optimizer,
        buffers=states.buffers,
        activations=_activations(shape, setup),
        logits=b * s * v * (setup.compute_bytes + 8),
        host=states.host,
    )


@dataclass(frozen=True)
class Available:
    """Memory per GPU to check against (None: not checked) and where the number came from."""

    gb: float | None
    source: str

    def describe(self) -> str:
        if self.gb is None:
            return f"not checked ({self.source})"
        return f"{self.gb:.1f} GB per GPU ({self.source})"


def detect_gpu_memory(gpu_type: str | None) -> tuple[float, str] | None:
    """Memory in GB of the smallest visible GPU matching `gpu_type` (any, when None), and its
    name; None without `nvidia-smi` or a matching GPU. Honours `CUDA_VISIBLE_DEVICES`."""
    rows: list[tuple[str, float]] = []
    for name, mib in query_gpus("name", "memory.total") or []:
        try:
            rows.append((name, float(mib) * 2**20 / GB))
        except ValueError:
            continue
    if gpu_type is not None:
        rows = [r for r in rows if gpu_name_matches(gpu_type, r[0])]
    if not rows:
        return None
    name, gb = min(rows, key=lambda r: r[1])
    return gb, name


def table_gpu_memory(gpu_type: str) -> tuple[float, str] | None:
    """`GPU_MEMORY_GB` for a GPU type ("H100", "nvidia-h100-80gb"), and the table's key."""
    for key, gb in GPU_MEMORY_GB.items():
        if gpu_name_matches(key, gpu_type):
            return gb, key
    return None


def available_memory(
    gpu_memory_gb: float | None, gpu_type: str | None, *, detect: bool = True
) -> Available:
    """Memory per GPU: `gpu_memory_gb`, else the detected GPU, else the GPU table.

    Args:
        gpu_memory_gb: Given on the command line / in the config.
        gpu_type: The config's `gpu_type` ("cpu": CPU ranks, nothing to check).
        detect: Ask `nvidia-smi` (tests pass False to stay independent of the machine).
    """
    if gpu_memory_gb is not None:
        return Available(float(gpu_memory_gb), "--gpu-memory-gb")
    if gpu_type is not None and gpu_type.strip().lower() == "cpu":
        return Available(None, "CPU ranks")
    found = detect_gpu_memory(gpu_type) if detect else None
    if found is not None:
        return Available(found[0], f"detected {found[1]}")
    if gpu_type is None:
        return Available(None, "no GPU detected: CPU ranks")
    table = table_gpu_memory(gpu_type)
    if table is not None:
        return Available(table[0], f"{table[1]} from the GPU table")
    return Available(None, f"GPU type {gpu_type!r} is neither detected nor in the GPU table")


def fits(estimate: Estimate, available: Available) -> bool:
    """True when nothing is to be checked or the estimate is within the memory."""
    return available.gb is None or estimate.total_gb <= available.gb


def refusal(estimate: Estimate, available: Available, advice: str = "") -> str:
    """The message naming the estimate, the memory available and the breakdown."""
    return (
        f"technique {estimate.technique} needs an estimated {estimate.total_gb:.1f} GB per GPU "
        f"but {available.describe()} is available: {estimate.breakdown()}"
        + (f"; {advice}" if advice else "")
    )


def check_fit(estimate: Estimate, available: Available, advice: str = "") -> None:
    """Refuse, before launch, a run whose estimate exceeds the memory per GPU.

    Raises:
        MemoryFitError: naming the estimated and available GB per GPU and the breakdown.
    """
    if not fits(estimate, available):
        raise MemoryFitError(refusal(estimate, available, advice))


def auto_candidates(precision: Precision, checkpointing: bool) -> list[Technique]:
    """What `--technique auto` tries, cheapest in communication first."""
    return [
        DDPConfig(),
        DeepSpeedConfig(zero_stage=2, mixed_precision=precision),
        FSDPConfig(mixed_precision=precision, activation_checkpointing=checkpointing),
        FSDPConfig(
            mixed_precision=precision, activation_checkpointing=checkpointing, cpu_offload=True
        ),
    ]


def choose_technique(
    shape: ModelShape,
    setup: TrainingSetup,
    available: Available,
    candidates: list[Technique],
) -> tuple[Technique, list[Estimate]]:
    """The first of `candidates` whose estimate fits, and the estimates tried until then.

    Raises:
        MemoryFitError: none fits; the message lists every estimate.
    """
    tried: list[Estimate] = []
    for technique in candidates:
        tried.append(estimate(shape, setup, technique))
        if fits(tried[-1], available):
            return technique, tried
    lines = "; ".join(f"{e.technique}: {e.breakdown()}" for e in tried)
    raise MemoryFitError(
        f"technique auto: no technique fits {shape.describe()} in {available.describe()}: "
        f"{lines}. Lower training.per_device_batch_size or max_length, turn on activation "
        "checkpointing, train a LoRA adapter, or add GPUs"
    )


@dataclass(frozen=True)
class MemoryPlan:
    """The technique a run uses, its estimate, and what `auto` tried before it."""

    requested: str
    technique: Technique
    shape: ModelShape
    setup: TrainingSetup
    estimate: Estimate
    available: Available
    tried: tuple[Estimate, ...] = ()

    @property
    def checked(self) -> bool:
        return self.available.gb is not None

    def lines(self) -> list[str]:
        """What is printed before launch."""
        s = self.setup
        training = "full fine-tuning" if s.lora_rank is None else f"LoRA r={s.lora_rank}"
        ckpt = ", activation checkpointing" if s.activation_checkpointing else ""
        out = [
            f"memory estimate: {self.shape.describe()}, {training}, {s.precision}, "
            f"batch {s.micro_batch_size} x {s.seq_len} tokens per GPU, {s.world_size} "
            f"rank(s){ckpt}; available: {self.available.describe()}"
        ]
        for e in self.tried[:-1]:
            out.append(f"  {e.technique}: {e.breakdown()}: does not fit")
        verdict = "fits" if self.checked else "not checked"
        out.append(f"  {self.estimate.technique}: {self.estimate.breakdown()}: {verdict}")
        if self.requested == "auto":
            out.append(f"technique auto -> {self.technique.describe()}")
        return out

    def params(self) -> dict[str, str]:
        """MLflow params of the run (`memory.*`)."""
        out = {
            "memory.technique_requested": self.requested,
            "memory.technique_chosen": self.technique.describe(),
            "memory.estimate_gb": f"{self.estimate.total_gb:.2f}",
            "memory.available_gb": "none"
            if self.available.gb is None
            else f"{self.available.gb:.2f}",
            "memory.available_source": self.available.source,
            "memory.model_params": str(self.shape.params),
        }
        out |= {f"memory.{k}_gb": f"{v:.2f}" for k, v in self.estimate.parts().items()}
        if self.estimate.host:
            out["memory.host_gb"] = f"{self.estimate.host / GB:.2f}"
        return out


class SFTRun(Protocol):
    """What `plan_sft` reads of an SFT run's config (`trainflow.configs.sft.SFTConfig`)."""

    model: str
    gpu_memory_gb: float | None
    gpu_type: str | None
    technique: Any

    def tokenizer_path(self) -> str: ...
    def training_setup(self) -> "TrainingSetup": ...
    def compute_precision(self) -> Precision: ...


def plan_sft(config: SFTRun, *, detect: bool = True) -> MemoryPlan:
    """The SFT run's memory plan: `technique: auto` resolved, any other technique checked.

    Raises:
        MemoryFitError: the technique (or, for auto, every candidate) does not fit the GPUs.
    """
    shape = model_shape(config.model, config.tokenizer_path())
    setup = config.training_setup()
    available = available_memory(config.gpu_memory_gb, config.gpu_type, detect=detect)
    technique = config.technique
    if isinstance(technique, Technique):  # else `auto`
        found = estimate(shape, setup, technique)
        check_fit(found, available, "try --technique auto, or see docs/sft.md for the formulas")
        return MemoryPlan(technique.name, technique, shape, setup, found, available, (found,))
    candidates = auto_candidates(config.compute_precision(), setup.activation_checkpointing)
    chosen, tried = choose_technique(shape, setup, available, candidates)
    return MemoryPlan("auto", chosen, shape, setup, tried[-1], available, tuple(tried))
