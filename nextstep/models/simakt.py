"""SimAKT (seed 001): a DTransformer knowledge tracer whose block 3 can give heads to past students.

Baseline (DTransformer, Yin et al. 2023), for a student's interactions (question q_t, response r_t):

    e_t  = E_skill(q_t) + mu(pid_t) * D_skill(q_t)                      question embedding (mu: problem difficulty)
    s_t  = E_resp(r_t) + e_t + mu(pid_t) * (D_resp(r_t) + D_skill(q_t))  interaction embedding
    hq   = block1(e, e, e)        questions, causal (j <= t)
    hs   = block2(s, s, s)        interactions, causal (j <= t)
    p    = block3(hq, hq, hs)     mix: queries and keys from questions, values from interactions (j <= t)
    z_t  = block4(know, hq, p)    n_know knowledge queries over positions j < t (nothing of step t)
    h_t  = sum_k softmax_k(know_k . e_t) z_tk                          read-out for the question asked
    P(r_t = 1) = sigmoid(MLP([e_t; h_t]))

so the prediction at t uses responses before t only. The blocks are in layers/decay_attention.py.

SimAKT: block 3 has `n_heads` head slots; the first `intra_heads` attend within the student as above, and
each inter-student head (layers/similarity.py) takes the next slot's query and attends to a memory bank of
past students instead, its output scaled by its `influence_weight`. An inter-student head that is disabled,
or whose influence weight is 0, is an ordinary intra-student head: with all of them off the model is the
DTransformer baseline with the same weights, exactly (tests/models/test_simakt.py).

Heads at the answer (`answer_heads`, layers/similarity.py's AnswerHead, e.g. "peers"): block 4 reads positions
before t only, so nothing in block 3 can know which question is asked at t. An answer head reads h_t and the
question asked, consults its bank (e.g. training students' answers to that question, weighted by how alike
their read-outs were) and adds a term to the logit; it starts at 0, so at initialisation the model is its
baseline. It changes no state: `step` and `rebase` never read its bank, `readout` and the full pass do.

Banks are inputs, not parameters: `bank_keys(banks)` turns raw banks (states (M, L, d), lengths (M,)) into
each active head's position-weighted keys and values (an answer head's bank is taken as built); every forward
takes those, block 3's first.

Streaming (what the service runs): every block is causal, so an interaction adds one row to each block and
changes no earlier row. For each of `caches` chunk caches the state keeps:
  - the chunk's raw interactions: blocks 1 and 2 read them at each step, cheaply: e and s are sums of table
    rows, so a new row's query meets each projected table once and its attention is gathered per position
    (`Block.row`, O(T + V d) a head);
  - block 3's keys and values of the intra-student slots (`cache_dtype`): a new row's query is qk(hq_t), its
    inter-student heads read the bank at position t (the latest row's inter-slot queries are kept for the
    explanation);
  - block 4's running state per knowledge query and head: the weighted mean of the values and the total
    weight, relative to the largest log-weight and rescaled when a row raises it (exact: the decay is linear
    in the distance).
`step` costs O(T d) per cache; `readout` is block 4's finish, the question embedding and the answer MLP.

Window rule: cache c holds chunks of `window` interactions starting at c * window / caches (mod window), each
from a fresh state. A prediction comes from the cache whose chunk began earliest, which has seen between
window - window / caches and window - 1 earlier interactions once the learner has that many (`caches` = 1: the
window restarts every `window` events). Offline, `rule_chunks` names the same chunks and the positions each
scores (`chunked`), so a served prediction is the full pass over its chunk. The inter-student heads' outputs
enter block 4's state, so a state belongs to the bank it was folded with; `rebase` encodes each cache's chunk
afresh with another bank.
"""

from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from .layers.decay_attention import MAX_WINDOW, Block, KnowledgeReadout, causal, visible
from .layers.similarity import AnswerHead, BankHead, answer_head_class, head_class


class ConfigError(ValueError):
    """A similarity configuration that cannot be built; the message starts with the offending key."""

    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}")
        self.where = where


@dataclass
class InterHeadSpec:
    type: str  # registered name ("cluster", "knn") or "package.module:ClassName"
    name: str  # unique; names the head's bank
    influence_weight: float = 1.0  # output scale; 0 turns the head into an intra-student head
    temperature: float = 0.1
    learn_temperature: bool = False
    size: int = 100  # bank entries: clusters (cluster) or samples (knn)
    k_neighbors: int = 15  # knn: entries each position attends to
    decay_factor: float = 0.95  # position weighting of bank entries (layers/similarity.py)
    future_weight: float = 0.3  # 0: an entry is compared up to the student's position only
    similarity_metric: str = "dot"  # cluster: "dot" (scaled dot product) or "cosine"
    enabled: bool = True

    @property
    def active(self) -> bool:
        return self.enabled and self.influence_weight > 0


@dataclass
class AnswerHeadSpec:
    type: str  # registered answer-stage name ("peers") or "package.module:ClassName"
    name: str  # unique among all heads; names the head's bank
    size: int = 128  # peers: bank entries kept per question row
    d_key: int = 32  # peers: width of the projected read-outs compared
    temperature: float = 1.0
    learn_temperature: bool = True
    enabled: bool = True

    @property
    def active(self) -> bool:
        return self.enabled


@dataclass
class SimilarityConfig:
    intra_heads: int
    inter_heads: list[InterHeadSpec] = field(default_factory=list)
    answer_heads: list[AnswerHeadSpec] = field(default_factory=list)  # heads at the answer (layers/similarity.py)

    @property
    def active(self) -> list[tuple[int, InterHeadSpec]]:
        """(block-3 head slot, spec) of every inter-student head that is on."""
        return [(self.intra_heads + i, h) for i, h in enumerate(self.inter_heads) if h.active]

    @property
    def answering(self) -> list[AnswerHeadSpec]:
        return [h for h in self.answer_heads if h.active]

    def to_dict(self) -> dict:
        return {"intra_heads": self.intra_heads, "inter_heads": [asdict(h) for h in self.inter_heads],
                "answer_heads": [asdict(h) for h in self.answer_heads]}


# configuration keys: the modular style's per-head keys (and the seed's aliases), and the dual style's
_HEAD_KEYS = {"type", "name", "influence_weight", "temperature", "initial_temperature", "learn_temperature",
              "adaptive_temperature", "size", "n_clusters", "memory_size", "k_neighbors", "decay_factor",
              "future_weight", "temporal_config", "similarity_metric", "distance_metric", "enabled", "description"}
_DUAL_KEYS = {"approach", "total_heads", "intra_heads", "inter_heads", "head_allocation", "cluster_config",
              "knn_config", "temporal_config", "description", "answer_heads"}
_ANSWER_KEYS = {"type", "name", "size", "d_key", "temperature", "learn_temperature", "enabled", "description"}
_APPROACHES = {"none": (), "cluster": ("cluster",), "knn": ("knn",), "dual_similarity": ("cluster", "knn"),
               "position_weighted_dual": ("cluster", "knn")}
_DEFAULTS = {"cluster": {"size": 100, "temperature": 0.05}, "knn": {"size": 200, "temperature": 0.1}}


def _number(where: str, value, *, low: float | None = None, high: float | None = None, integer: bool = False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise ConfigError(where, f"must be {'an integer' if integer else 'a number'}, got {value!r}")
    if value != value or (low is not None and value < low) or (high is not None and value > high):
        bounds = f"{'' if low is None else f'>= {low}'}{' and ' if low is not None and high is not None else ''}" \
                 f"{'' if high is None else f'<= {high}'}"
        raise ConfigError(where, f"must be {bounds}, got {value!r}")
    return value


def _kind_and_name(where: str, d: dict, keys: set[str], lookup, kind: str | None = None) -> tuple[str, str]:
    """A head entry's checked keys, its type (a class `lookup` finds) and its name."""
    if not isinstance(d, dict):
        raise ConfigError(where, f"must be an object, got {d!r}")
    unknown = sorted(set(d) - keys)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", f"unknown key (allowed: {sorted(keys)})")
    kind = kind or d.get("type")
    if not isinstance(kind, str):
        raise ConfigError(f"{where}.type", f"required: a head type, got {kind!r}")
    try:
        cls = lookup(kind)
    except ValueError as e:
        raise ConfigError(f"{where}.type", str(e)) from None
    name = d.get("name", kind if ":" not in kind else cls.__name__.lower())
    if not (isinstance(name, str) and name.isidentifier() and name.isascii()):
        raise ConfigError(f"{where}.name", f"must be letters, digits and '_' (it names graph inputs), got {name!r}")
    return kind, name


def _head(where: str, d: dict, kind: str | None = None, temporal: dict | None = None) -> InterHeadSpec:
    kind, name = _kind_and_name(where, d, _HEAD_KEYS, head_class, kind)
    t = {**(temporal or {}), **d.get("temporal_config", {})}
    unknown = sorted(set(t) - {"decay_factor", "future_weight", "strategy"})
    if unknown:
        raise ConfigError(f"{where}.temporal_config.{unknown[0]}",
                          "unknown key (decay_factor, future_weight, strategy)")
    if t.get("strategy", "position_weighted") != "position_weighted":
        raise ConfigError(f"{where}.temporal_config.strategy",
                          f"only 'position_weighted' is built, got {t['strategy']!r}")
    if d.get("distance_metric", "euclidean") != "euclidean":
        raise ConfigError(f"{where}.distance_metric", f"only 'euclidean' is built, got {d['distance_metric']!r}")
    base = _DEFAULTS.get(kind, {})
    spec = InterHeadSpec(type=kind, name=name)
    spec.influence_weight = float(_number(f"{where}.influence_weight", d.get("influence_weight", 1.0), low=0))
    temp = d.get("temperature", d.get("initial_temperature", base.get("temperature", spec.temperature)))
    spec.temperature = float(_number(f"{where}.temperature", temp, low=1e-4))
    if temp <= 0:
        raise ConfigError(f"{where}.temperature", f"must be > 0, got {temp!r}")
    learn = d.get("learn_temperature", d.get("adaptive_temperature", False))
    if not isinstance(learn, bool):
        raise ConfigError(f"{where}.learn_temperature", f"must be true or false, got {learn!r}")
    spec.learn_temperature = learn
    size = d.get("size", d.get("n_clusters", d.get("memory_size", base.get("size", spec.size))))
    spec.size = _number(f"{where}.size", size, low=1, integer=True)
    spec.k_neighbors = _number(f"{where}.k_neighbors", d.get("k_neighbors", spec.k_neighbors), low=1, integer=True)
    if kind == "knn" and spec.k_neighbors > spec.size:
        raise ConfigError(f"{where}.k_neighbors", f"{spec.k_neighbors} neighbours from a bank of {spec.size}")
    spec.decay_factor = float(_number(f"{where}.temporal_config.decay_factor", t.get("decay_factor", 0.95),
                                      low=0.5, high=1.0))
    spec.future_weight = float(_number(f"{where}.temporal_config.future_weight", t.get("future_weight", 0.3),
                                       low=0.0, high=1.0))
    metric = d.get("similarity_metric", "dot")
    if metric not in ("dot", "cosine"):
        raise ConfigError(f"{where}.similarity_metric", f"must be 'dot' or 'cosine', got {metric!r}")
    spec.similarity_metric = metric
    if not isinstance(d.get("enabled", True), bool):
        raise ConfigError(f"{where}.enabled", f"must be true or false, got {d['enabled']!r}")
    spec.enabled = d.get("enabled", True)
    return spec


def _answer_head(where: str, d: dict) -> AnswerHeadSpec:
    kind, name = _kind_and_name(where, d, _ANSWER_KEYS, answer_head_class)
    spec = AnswerHeadSpec(type=kind, name=name)
    spec.size = _number(f"{where}.size", d.get("size", spec.size), low=1, integer=True)
    spec.d_key = _number(f"{where}.d_key", d.get("d_key", spec.d_key), low=1, integer=True)
    spec.temperature = float(_number(f"{where}.temperature", d.get("temperature", spec.temperature), low=1e-3))
    for key in ("learn_temperature", "enabled"):
        if not isinstance(d.get(key, True), bool):
            raise ConfigError(f"{where}.{key}", f"must be true or false, got {d[key]!r}")
    spec.learn_temperature, spec.enabled = d.get("learn_temperature", True), d.get("enabled", True)
    return spec


def parse_similarity(data: dict | None, n_heads: int) -> SimilarityConfig:
    """Validate a similarity configuration of either style of seed 001 and return it.

    Modular: {"intra_heads": N, "inter_heads": [{"type": "cluster", ...}, ...]}, N + len(inter) = n_heads.
    Fixed dual: {"approach": "none" | "cluster" | "knn" | "position_weighted_dual", "cluster_config": {...},
    "knn_config": {...}, "temporal_config": {...}}, optionally with the head counts it implies.
    Either style may add "answer_heads": [{"type": "peers", ...}], heads at the answer that take no slot of
    block 3. A {"similarity_config": {...}} wrapper is unwrapped. None or {} is the baseline (every head intra)."""
    if data is None or data == {}:
        return SimilarityConfig(intra_heads=n_heads)
    if not isinstance(data, dict):
        raise ConfigError("similarity_config", f"must be an object, got {type(data).__name__}")
    if set(data) == {"similarity_config"}:
        data = data["similarity_config"]
    if isinstance(data.get("inter_heads"), list):  # modular
        unknown = sorted(set(data) - {"intra_heads", "inter_heads", "total_heads", "description", "answer_heads"})
        if unknown:
            raise ConfigError(unknown[0], "unknown key in a modular configuration (intra_heads, inter_heads)")
        heads = [_head(f"inter_heads[{i}]", h) for i, h in enumerate(data["inter_heads"])]
        intra = _number("intra_heads", data.get("intra_heads", n_heads - len(heads)), low=0, integer=True)
    else:  # fixed dual
        unknown = sorted(set(data) - _DUAL_KEYS)
        if unknown:
            raise ConfigError(unknown[0], f"unknown key (allowed: {sorted(_DUAL_KEYS)})")
        approach = data.get("approach", "none")
        if approach not in _APPROACHES:
            raise ConfigError("approach", f"must be one of {sorted(_APPROACHES)}, got {approach!r}")
        temporal = data.get("temporal_config", {})
        if not isinstance(temporal, dict):
            raise ConfigError("temporal_config", f"must be an object, got {temporal!r}")
        heads = [_head(f"{kind}_config", data.get(f"{kind}_config", {}), kind, temporal)
                 for kind in _APPROACHES[approach]]
        declared = data.get("inter_heads", len(heads))
        if declared != len(heads):
            raise ConfigError("inter_heads", f"approach {approach!r} has {len(heads)} inter-student heads, "
                                             f"the configuration says {declared!r}")
        intra = _number("intra_heads", data.get("intra_heads", n_heads - len(heads)), low=0, integer=True)
    total = data.get("total_heads", n_heads)
    if total != n_heads:
        raise ConfigError("total_heads", f"the model has {n_heads} heads in block 3, the configuration says {total!r}")
    if intra + len(heads) != n_heads:
        raise ConfigError("intra_heads", f"{intra} intra-student + {len(heads)} inter-student heads != the "
                                         f"{n_heads} heads of block 3")
    answer = data.get("answer_heads", [])
    if not isinstance(answer, list):
        raise ConfigError("answer_heads", f"must be a list, got {answer!r}")
    answer = [_answer_head(f"answer_heads[{i}]", h) for i, h in enumerate(answer)]
    names = [h.name for h in heads] + [h.name for h in answer]
    for i, name in enumerate(names):
        if names.index(name) != i:
            where = f"inter_heads[{i}]" if i < len(heads) else f"answer_heads[{i - len(heads)}]"
            raise ConfigError(f"{where}.name", f"{name!r} is used twice: every head needs its own bank name")
    return SimilarityConfig(intra_heads=intra, inter_heads=heads, answer_heads=answer)


@dataclass
class SimAKTConfig:
    n_questions: int  # vocabulary rows: 0 padding, 1 unknown, then (problem, skill) pairs and bare skills
    n_skills: int  # skill rows: 0 padding, 1 unknown, then skills
    n_problems: int = 0  # problem rows (0 padding, 1 unknown); 0 = the data has no problem ids
    d_model: int = 128
    n_heads: int = 8
    n_know: int = 16
    d_fc: int = 256
    dropout: float = 0.2
    window: int = 200  # interactions of a chunk: the longest training chunk and a served cache's length
    similarity: dict = field(default_factory=dict)  # parse_similarity input, kept raw for the manifest
    caches: int = 2  # served chunk caches, staggered by window / caches (the window rule, module docstring)
    cache_dtype: str = "float16"  # block 3's cached keys and values in the served state: float16 or float32

    def __post_init__(self):
        if not 1 <= self.window <= MAX_WINDOW:
            raise ValueError(f"window must be in 1..{MAX_WINDOW}, got {self.window}")
        if not (isinstance(self.caches, int) and self.caches >= 1 and self.window % self.caches == 0):
            raise ValueError(f"caches must be a divisor of the window {self.window}, got {self.caches!r}")
        if self.cache_dtype not in ("float16", "float32"):
            raise ValueError(f"cache_dtype must be float16 or float32, got {self.cache_dtype!r}")


def rule_chunks(length: int, window: int, caches: int) -> list[tuple[int, int]]:
    """The window rule offline, for a sequence of `length` interactions: (start, first scored position) of each
    chunk that scores some. Chunks of `window` start every window / caches; chunk 0 scores all its positions,
    a later one its last window / caches (where it has more history than any other chunk), so every
    interaction is scored once, by the chunk `readout` predicts it from."""
    S = window // caches
    return [(0, 0)] + [(start, window - S) for start in range(S, max(length - window + S, 0), S)]


class SimAKTOutput(NamedTuple):
    logits: torch.Tensor  # (B, T) or (B, M): log-odds of a right response
    inter_weights: list[torch.Tensor]  # per active inter head: (B, T, M_bank) attention over its bank
    knowledge: torch.Tensor | None = None  # full pass: z (B, T, n_know, d), what the contrastive loss compares


class SimilarityBlock(nn.Module):
    """Block 3: intra-student decayed attention in every slot, then each active inter head replaces its slot."""

    def __init__(self, d_model: int, n_heads: int, dropout: float, similarity: SimilarityConfig):
        super().__init__()
        self.block = Block(d_model, n_heads, dropout)
        self.similarity = similarity
        d_head = d_model // n_heads
        self.inter = nn.ModuleDict({h.name: head_class(h.type)(d_model, d_head, h) for h in similarity.inter_heads})
        self.active = similarity.active

    @property
    def intra(self) -> list[int]:
        """The slots that attend within the student: all but the active inter-student heads'."""
        taken = {slot for slot, _ in self.active}
        return [h for h in range(self.block.attn.n_heads) if h not in taken]

    def heads(self, hq: torch.Tensor, hs: torch.Tensor, bank_kv: list[tuple[torch.Tensor, torch.Tensor]]):
        """Per-slot outputs before the output projection (B, H, T, dh), and each active head's bank weights."""
        a = self.block.attn
        q = a.heads(hq, a.qk)  # (B, H, T, dh); keys are the same projection (kq_same)
        heads = a.attend(q, q, a.heads(hs, a.v), *causal(hq.shape[1], True, hq.device))
        if not self.active:
            return heads, []
        slots, weights = list(heads.unbind(1)), []
        for (slot, spec), (keys, values) in zip(self.active, bank_kv, strict=True):
            out, w = self.inter[spec.name](q[:, slot], keys, values)
            slots[slot] = spec.influence_weight * out
            weights.append(w)
        return torch.stack(slots, 1), weights

    def forward(self, hq: torch.Tensor, hs: torch.Tensor, bank_kv: list[tuple[torch.Tensor, torch.Tensor]]):
        b = self.block
        heads, weights = self.heads(hq, hs, bank_kv)
        return b.norm(hq + b.dropout(b.attn.merge(heads))), weights

    def row(self, hq: torch.Tensor, hs: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, at: torch.Tensor,
            bank_kv: list[tuple[torch.Tensor, torch.Tensor]]):
        """One new row per sequence: hq, hs (N, d) at position at (N,) with the intra slots' cached keys and values
        (N, T, n_intra * dh) -> (p (N, d), keys and values with the row written in their dtype, the active inter
        slots' queries (N, n_active, dh))."""
        b, a = self.block, self.block.attn
        N, T, _ = keys.shape
        intra = self.intra
        q = a.heads(hq[:, None], a.qk)[:, :, 0]  # (N, H, dh)
        k, v = q[:, intra].reshape(N, 1, -1), a.heads(hs[:, None], a.v)[:, intra, 0].reshape(N, 1, -1)
        here = (torch.arange(T, device=at.device) == at[:, None]).unsqueeze(-1)  # (N, T, 1)
        # earlier rows as stored, the row's own exact: its rounding cannot move this row's output
        split = lambda new, old: torch.where(here, new, old.float()).view(N, T, len(intra), a.d_head).transpose(1, 2)  # noqa: E731
        mask, gap = visible(at[:, None, None], T, True)
        own = a.attend(q[:, intra, None], split(k, keys), split(v, values), mask, gap, heads=intra)[:, :, 0]
        keys, values = torch.where(here, k.to(keys.dtype), keys), torch.where(here, v.to(values.dtype), values)
        slots = dict(zip(intra, own.unbind(1), strict=True))
        for (slot, spec), (bank_keys, bank_values) in zip(self.active, bank_kv, strict=True):
            slots[slot] = spec.influence_weight * self.inter[spec.name].row(q[:, slot], bank_keys, bank_values, at)[0]
        heads = torch.stack([slots[h] for h in range(a.n_heads)], 1)[:, :, None]  # (N, H, 1, dh)
        p = b.norm(hq + b.dropout(a.merge(heads)[:, 0]))
        return p, keys, values, q[:, [slot for slot, _ in self.active]]


class SimAKT(nn.Module):
    family = "simakt"
    task = "knowledge_tracing"

    def __init__(self, cfg: SimAKTConfig):
        super().__init__()
        self.cfg = cfg
        self.sim = parse_similarity(cfg.similarity, cfg.n_heads)
        d = cfg.d_model
        self.skill_embed = nn.Embedding(cfg.n_skills, d)
        self.resp_embed = nn.Embedding(2, d)
        if cfg.n_problems:
            self.skill_diff = nn.Embedding(cfg.n_skills, d)
            self.resp_diff = nn.Embedding(2, d)
            self.problem_diff = nn.Embedding(cfg.n_problems, 1)
            nn.init.zeros_(self.problem_diff.weight)  # every problem starts at its skill's mean
        # vocabulary row -> skill row and problem row (set by training from the data's pairs)
        self.register_buffer("question_skill", torch.arange(cfg.n_questions).clamp(max=cfg.n_skills - 1))
        self.register_buffer("question_problem", torch.zeros(cfg.n_questions, dtype=torch.long))
        self.block1 = Block(d, cfg.n_heads, cfg.dropout)
        self.block2 = Block(d, cfg.n_heads, cfg.dropout)
        self.block3 = SimilarityBlock(d, cfg.n_heads, cfg.dropout, self.sim)
        self.block4 = KnowledgeReadout(d, cfg.n_heads, cfg.n_know, cfg.dropout)
        self.out = nn.Sequential(nn.Linear(2 * d, cfg.d_fc), nn.GELU(), nn.Dropout(cfg.dropout),
                                 nn.Linear(cfg.d_fc, cfg.d_fc // 2), nn.GELU(), nn.Dropout(cfg.dropout),
                                 nn.Linear(cfg.d_fc // 2, 1))
        self.answer_heads = nn.ModuleDict({h.name: answer_head_class(h.type)(d, h) for h in self.sim.answering})

    # ------------------------------------------------------------------ pieces
    @property
    def heads(self) -> list[BankHead]:
        """The active inter-student heads, in the order bank inputs are given."""
        return [self.block3.inter[spec.name] for _, spec in self.sim.active]

    def _parts(self, questions: torch.Tensor, responses: torch.Tensor | None):
        """The question embedding e (responses None) or the interaction embedding s as a sum of table rows:
        [(table (V, d), rows, coefficient (..., 1) or None)], with mu the problem difficulty:
        e = E_skill + mu D_skill,  s = e + E_resp + mu (D_resp + D_skill)."""
        skill = self.question_skill[questions]
        mu = self.problem_diff(self.question_problem[questions]) if self.cfg.n_problems else None
        parts = [(self.skill_embed.weight, skill, None)] + ([(self.skill_diff.weight, skill, mu)] if mu is not None
                                                            else [])
        if responses is not None:
            parts.append((self.resp_embed.weight, responses, None))
            if mu is not None:
                parts += [(self.resp_diff.weight, responses, mu), (self.skill_diff.weight, skill, mu)]
        return parts

    def embed(self, questions: torch.Tensor, responses: torch.Tensor | None = None) -> torch.Tensor:
        """e (or s, with responses) for vocabulary rows of any shape."""
        out = None
        for table, rows, coef in self._parts(questions, responses):
            x = nn.functional.embedding(rows, table)
            x = x if coef is None else coef * x
            out = x if out is None else out + x
        return out

    def trajectory_states(self, questions: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """hs (B, T, d): block 2's interaction states, what memory banks are made of."""
        s = self.embed(questions, responses)
        return self.block2(s, s, s, peek_current=True)

    @property
    def answerers(self) -> list[AnswerHead]:
        """The active heads at the answer, in the order their banks follow block 3's."""
        return list(self.answer_heads.values())

    def bank_keys(self, banks: list[tuple[torch.Tensor, ...]]) -> list[tuple[torch.Tensor, ...]]:
        """Raw banks, one per active head (block 3's, then the answer heads') -> what the graphs take: for block 3's
        (states (M, L, d), lengths (M,)) -> (keys, values), each (L, M, dh); an answer head's bank as it is."""
        n = len(self.heads)
        if len(banks) != n + len(self.answerers):
            raise ValueError(f"{n} active inter-student heads and {len(self.answerers)} answer heads need as many "
                             f"banks, got {len(banks)}")
        return [head.project(states, lengths) for head, (states, lengths) in zip(self.heads, banks[:n], strict=True)] \
            + [tuple(bank) for bank in banks[n:]]

    def _encode(self, questions, responses, bank_kv):
        e, s = self.embed(questions), self.embed(questions, responses)
        hq = self.block1(e, e, e, peek_current=True)
        hs = self.block2(s, s, s, peek_current=True)
        p, weights = self.block3(hq, hs, bank_kv)
        return e, hq, hs, p, weights

    def readouts(self, questions: torch.Tensor, responses: torch.Tensor,
                 bank_kv: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> torch.Tensor:
        """h (B, T, d): the knowledge read out for each question before its answer (bank_kv: block 3's banks only);
        what answer heads' banks are made of."""
        e, hq, _, p, _ = self._encode(questions, responses, list(bank_kv))
        return self.read(e, self.block4(hq, p))

    def read(self, e: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """e (B, R, d) questions asked, z (B, R or 1, K, d) knowledge states -> h (B, R, d): the knowledge read out
        for each question, what the answer MLP reads."""
        attn = torch.softmax(torch.einsum("brd,kd->brk", e, self.block4.know), dim=-1)
        return torch.einsum("brk,brkd->brd", attn, z.expand(-1, e.shape[1], -1, -1))

    def mlp(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The answer MLP's logits (B, R) from the questions' embeddings e and read-outs h (B, R, d)."""
        return self.out(torch.cat([e, h], dim=-1)).squeeze(-1)

    def _answer(self, questions: torch.Tensor, e: torch.Tensor, z: torch.Tensor, answer_banks=()) -> torch.Tensor:
        """questions (B, R) rows, e (B, R, d) their embeddings, z (B, R or 1, K, d) knowledge states -> logits
        (B, R): the answer MLP, plus each answer head's term (its bank: `answer_banks`)."""
        h = self.read(e, z)
        logits = self.mlp(e, h)
        for head, bank in zip(self.answerers, answer_banks, strict=True):
            logits = logits + head(h, questions, *bank)
        return logits

    # ------------------------------------------------------------------ full pass (training)
    def forward(self, questions: torch.Tensor, responses: torch.Tensor,
                bank_kv: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> SimAKTOutput:
        """Teacher-forced: logits[:, t] predicts responses[:, t] from interactions before t."""
        n = len(self.heads)
        e, hq, _, p, weights = self._encode(questions, responses, list(bank_kv[:n]))
        z = self.block4(hq, p)
        return SimAKTOutput(self._answer(questions, e, z, bank_kv[n:]), weights, z)

    def chunked(self, questions: torch.Tensor, responses: torch.Tensor,
                bank_kv: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> torch.Tensor:
        """logits (B, T) under the window rule: each interaction predicted by the full pass over the chunk that
        `readout` predicts it from (`rule_chunks`; the rule depends on the position only, so padding is fine)."""
        return self._by_rule(lambda q, r: self(q, r, bank_kv).logits, questions, responses)

    def chunked_readouts(self, questions: torch.Tensor, responses: torch.Tensor,
                         bank_kv: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> torch.Tensor:
        """h (B, T, d) under the window rule, what `chunked` reads out for each question (bank_kv: block 3's)."""
        return self._by_rule(lambda q, r: self.readouts(q, r, bank_kv), questions, responses)

    def _by_rule(self, fn, questions: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """fn(chunk questions, chunk responses) -> (B, W, ...) over the rule's chunks, each position from its own."""
        W = self.cfg.window
        return torch.cat([fn(questions[:, start:start + W], responses[:, start:start + W])[:, first:]
                          for start, first in rule_chunks(questions.shape[1], W, self.cfg.caches)], 1)

    # ------------------------------------------------------------------ streaming (serving)
    def state_spec(self) -> list[dict]:
        c = self.cfg
        C, W, K, H, dh = c.caches, c.window, c.n_know, c.n_heads, c.d_model // c.n_heads
        rows = [C, W, len(self.block3.intra) * dh]
        spec = [{"name": "seen", "shape": [], "dtype": "int64", "init": "zeros"},
                {"name": "chunk_questions", "shape": [C, W], "dtype": "int64", "init": "zeros"},
                {"name": "chunk_responses", "shape": [C, W], "dtype": "int64", "init": "zeros"},
                {"name": "block3_keys", "shape": rows, "dtype": c.cache_dtype, "init": "zeros"},
                {"name": "block3_values", "shape": rows, "dtype": c.cache_dtype, "init": "zeros"},
                {"name": "know_mix", "shape": [C, K, H, dh + 1], "dtype": "float32", "init": "zeros"},
                {"name": "know_top", "shape": [C, K, H], "dtype": "float32", "init": "-1e30 (no row yet)"}]
        if self.sim.active:
            spec.append({"name": "latest_query", "shape": [C, len(self.sim.active) * dh], "dtype": "float32",
                         "init": "zeros"})
        return spec

    def init_state(self, B: int) -> tuple[torch.Tensor, ...]:
        dev = self.skill_embed.weight.device
        return tuple(torch.full((B, *s["shape"]), KnowledgeReadout.EMPTY if s["name"] == "know_top" else 0,
                                dtype=getattr(torch, s["dtype"]), device=dev) for s in self.state_spec())

    def _positions(self, seen: torch.Tensor) -> torch.Tensor:
        """(B, C): the position of interaction number `seen` in each cache's chunk."""
        C, W = self.cfg.caches, self.cfg.window
        return (seen[:, None] - torch.arange(C, device=seen.device) * (W // C)).remainder(W)

    def _predicting(self, seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache, position) (B,) of the prediction for interaction number `seen`: the chunk that began earliest."""
        C, S = self.cfg.caches, self.cfg.window // self.cfg.caches
        chunk = (seen // S - (C - 1)).clamp(min=0)
        return chunk.remainder(C), seen - chunk * S

    def step(self, state, question: torch.Tensor, response: torch.Tensor,
             bank_kv: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> tuple[torch.Tensor, ...]:
        """Add one interaction to every cache: its row of blocks 1-3 and its terms in block 4's state. A cache whose
        chunk this completes empties that state: its next interaction starts a chunk (rows past a cache's position
        are never read, so they need no clearing)."""
        seen, questions, responses, keys, values, mix, top, *latest = state
        B, C, W = questions.shape
        N = B * C
        at = self._positions(seen)
        here = torch.arange(W, device=at.device) == at[..., None]  # (B, C, W)
        questions = torch.where(here, question[:, None, None], questions)
        responses = torch.where(here, response[:, None, None], responses)
        at, q, r = at.reshape(N), questions.reshape(N, W), responses.reshape(N, W)
        each = lambda x: x[:, None].expand(B, C, *x.shape[1:]).reshape(N, *x.shape[1:])  # noqa: E731
        hq = self.block1.row(each(self.embed(question)), self._parts(q, None), at)
        hs = self.block2.row(each(self.embed(question, response)), self._parts(q, r), at)
        p, keys, values, query = self.block3.row(hq, hs, keys.reshape(N, W, -1), values.reshape(N, W, -1), at,
                                                 list(bank_kv[:len(self.heads)]))
        mix, top = self.block4.add(mix.reshape(N, *mix.shape[2:]), top.reshape(N, *top.shape[2:]), hq, p, at)
        done = (at == W - 1)[:, None, None]  # the chunk is complete: the cache's next interaction starts one
        mix, top = torch.where(done[..., None], 0.0, mix), torch.where(done, KnowledgeReadout.EMPTY, top)
        out = (seen + 1, questions, responses, keys.view(B, C, W, -1), values.view(B, C, W, -1),
               mix.view(B, C, *mix.shape[1:]), top.view(B, C, *top.shape[1:]))
        return out + ((query.reshape(B, C, -1),) if latest else ())

    def readout(self, state, questions: torch.Tensor,
                bank_kv: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> SimAKTOutput:
        """questions (B, M) at the next position -> logits (B, M) from the predicting cache's block-4 state; with the
        banks, each active head's weights (B, M_bank) at that cache's latest row (zeros before it has one)."""
        seen, _, _, _, _, mix, _, *latest = state
        B = seen.shape[0]
        cache, at = self._predicting(seen)

        def pick(x):  # (B, C, ...) -> the predicting cache's (B, ...)
            index = cache.view(B, 1, *[1] * (x.dim() - 2)).expand(B, 1, *x.shape[2:])
            return x.gather(1, index)[:, 0]

        z = self.block4.finish(pick(mix))
        weights, n = [], len(self.heads)
        if latest and bank_kv:
            query = pick(latest[0]).view(B, n, -1)
            row = (at - 1).clamp(min=0)
            for i, (head, (keys, values)) in enumerate(zip(self.heads, bank_kv[:n], strict=True)):
                w = head.row(query[:, i], keys, values, row)[1]
                weights.append(w * (at > 0)[:, None].to(w.dtype))
        return SimAKTOutput(self._answer(questions, self.embed(questions), z, bank_kv[n:]), weights)

    def rebase(self, seen: torch.Tensor, questions: torch.Tensor, responses: torch.Tensor,
               bank_kv: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> tuple[torch.Tensor, ...]:
        """The state that stepping reaches, from the interactions alone (seen (B,), the chunks (B, C, W)): each
        cache's chunk encoded by the full pass with these banks. For a state folded with another bank version."""
        B, C, W = questions.shape
        N = B * C
        count = self._positions(seen).reshape(N)
        _, hq, hs, p, _ = self._encode(questions.reshape(N, W), responses.reshape(N, W),
                                       list(bank_kv[:len(self.heads)]))
        a, intra = self.block3.block.attn, self.block3.intra
        k = a.heads(hq, a.qk)  # (N, H, W, dh)
        rows = lambda x: x[:, intra].transpose(1, 2).reshape(B, C, W, -1).to(getattr(torch, self.cfg.cache_dtype))  # noqa: E731
        mix, top = self.block4.running(hq, p, count)
        out = (seen, questions, responses, rows(k), rows(a.heads(hs, a.v)), mix.view(B, C, *mix.shape[1:]),
               top.view(B, C, *top.shape[1:]))
        if not self.sim.active:
            return out
        latest = k[torch.arange(N, device=k.device), :, (count - 1).clamp(min=0)]  # (N, H, dh)
        return out + (latest[:, [slot for slot, _ in self.block3.active]].reshape(B, C, -1),)


def regularisation(model: SimAKT) -> torch.Tensor:
    """DTransformer's L2 on the problem difficulties (keeps rare problems near their skill)."""
    if not model.cfg.n_problems:
        return model.skill_embed.weight.new_zeros(())
    return (model.problem_diff.weight ** 2).sum()


def _augment(questions, responses, mask, rate: float, generator: torch.Generator):
    """DTransformer's views of a batch: (questions, responses) with random adjacent interactions swapped, and
    the responses with random ones flipped (the hard negative); each at about `rate` of the positions."""
    B, T = questions.shape
    draw = torch.rand(B, T, generator=generator).to(questions.device) < rate
    swap = draw & mask & torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], 1)  # i and i + 1 both real
    swap = swap & ~torch.cat([torch.zeros_like(swap[:, :1]), swap[:, :-1]], 1)  # no overlapping swaps
    after = torch.cat([torch.zeros_like(swap[:, :1]), swap[:, :-1]], 1)  # the partner of each swap
    idx = torch.arange(T, device=questions.device).expand(B, T) + swap.long() - after.long()
    flip = (torch.rand(B, T, generator=generator).to(questions.device) < rate) & mask
    return (questions.gather(1, idx), responses.gather(1, idx)), torch.where(flip, 1 - responses, responses)


def contrastive_loss(model: SimAKT, questions, responses, mask, bank_kv, z: torch.Tensor, *, rate: float = 0.2,
                     temperature: float = 0.05, generator: torch.Generator) -> torch.Tensor:
    """DTransformer's contrastive loss (optional, `lambda_cl`): at every position, a student's knowledge
    states (z averaged over the knowledge queries) should be closer, by cosine / temperature, to those of
    their own sequence with a few adjacent interactions swapped than to any other student's, and than to
    their own sequence with a few responses flipped (hard negative). `z` is the original pass's."""
    (q2, r2), flipped = _augment(questions, responses, mask, rate, generator)
    z1 = z.mean(2)  # (B, T, d)
    z2 = model(q2, r2, bank_kv).knowledge.mean(2)
    z3 = model(questions, flipped, bank_kv).knowledge.mean(2)
    unit = torch.nn.functional.normalize
    z1, z2, z3 = unit(z1, dim=-1), unit(z2, dim=-1), unit(z3, dim=-1)
    sims = torch.einsum("btd,ctd->btc", z1, z2) / temperature  # (B, T, B): row b, candidate c
    sims = sims.masked_fill(~mask.T[None].expand(z1.shape[0], -1, -1), -1e4)  # a candidate padded at t
    hard = (z1 * z3).sum(-1, keepdim=True) / temperature  # (B, T, 1)
    logits = torch.cat([sims, hard], -1)[mask]  # (N, B + 1)
    target = torch.arange(z1.shape[0], device=z.device)[:, None].expand(-1, z1.shape[1])[mask]
    return torch.nn.functional.cross_entropy(logits, target)
