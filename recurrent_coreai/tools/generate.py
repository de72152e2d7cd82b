"""``python -m recurrent_coreai generate --model M --recipe R "prompt"``: talk to a built bundle.

Loads the lowered bundle (``results/<m>/aot/universal/<r>/<bundle>.aimodelx``) in the Core AI
runtime with the model's tokenizer (its kind, ``models.<m>.tokenizer`` or its family's, over
``results/<m>/vocab/``), feeds the chat
prompt (the tokenizer kind's format) and decodes — greedy by default, or seeded
temperature / top-k / top-p sampling with a repetition penalty — until the end-of-text token, a
stop string or ``--max-new-tokens``. Text streams to stdout as it is decoded and never splits a
UTF-8 character (a character whose bytes span several tokens is held back until complete);
prompt and decode speeds go to stderr, separately.

The prompt goes through the bundle's chunked prefill function when ``export.json`` lists one
(``functions``, role ``prefill``): full chunks through prefill, the tail through decode
(:class:`.coreai_runtime.PromptSession`); otherwise, or with ``--main-only``, every prompt token
goes through the decode function (``main``).

The session is driven from the bundle's runner contract (stages/runner_contract.py: function
names, roles, states, prefill chunk, start ids, chat stop strings, the bundle's and tokenizer's
digests) -- built from the stage records for ``--model``/``--recipe``, or read from a published
bundle folder with ``--bundle`` (``runner.json``, ``tokenizer/``, the ``.aimodelx``).

State files (coreai/state_file.py): ``--save-state FILE`` writes the states after the prompt
(``--save-at prompt``, the default) or after the generated text (``--save-at end``: the prompt and
every generated token, the end-of-text token excepted); ``--load-state FILE`` starts from such a
state, and the prompt is then fed without the start token, as the continuation of what the state
holds. From Python: :func:`save_state`, :func:`load_state`.
"""

from __future__ import annotations

import codecs
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from recurrent_coreai.pipeline import config as cfgmod
from recurrent_coreai.coreai import state_file
from recurrent_coreai.coreai.runtime import DecodeSession, PromptSession, state_spec
from recurrent_coreai.coreai.entrypoints import DECODE, PREFILL, bundle_functions
from recurrent_coreai.stages import runner_contract
from recurrent_coreai.util.errors import PipelineError, main_guard
from recurrent_coreai.util.fsutil import sha256_file
from recurrent_coreai.pipeline.paths import Layout
from recurrent_coreai.pipeline.records import AOT, read_aot, read_export, read_vocab
from recurrent_coreai.tools.one_line_parser import OneLineParser, utf8_text
from recurrent_coreai.tools.sampling import Sampler, Sampling
from recurrent_coreai import families, tokenizers

DEFAULT_STOP = runner_contract.CHAT_STOP  # the chat format's next turn (a contract's chat.stop says its own)


def feed(session, tokens: Sequence[int]) -> np.ndarray:
    """The prompt through ``session.feed`` (prefill chunks + decode tail) when the session has one,
    else token by token through ``session.step``; the logits after the last token."""
    if not tokens:
        raise ValueError("feed needs at least one token")
    if hasattr(session, "feed"):
        return session.feed(list(tokens))
    logits = None
    for tok in tokens:
        logits = session.step(int(tok))
    return logits


def prompt_route(session, n_tokens: int) -> str:
    """Which functions a prompt of ``n_tokens`` goes through (for the speed line)."""
    chunk = getattr(session, "chunk", None)
    decode = session.function
    if chunk and n_tokens >= chunk:
        return f"{session.prefill_function} {n_tokens // chunk}x{chunk} + {decode} {n_tokens % chunk}x1"
    return decode


class TextStream:
    """Bytes of tokens in, text out: a UTF-8 character split over tokens is held back until its
    last byte arrives (invalid bytes become U+FFFD), and text that may be the start of a stop
    string is held back until it is known not to be one. :attr:`stopped` is set when a stop
    string is complete; the text up to it has then been returned and nothing after it is."""

    def __init__(self, stop: Sequence[str] = ()):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = [s for s in stop if s]
        self._held = ""
        self.stopped: str | None = None

    def push(self, data: bytes) -> str:
        """Text that is now safe to show."""
        return self._emit(self._decoder.decode(data))

    def close(self) -> str:
        """The rest (incomplete trailing bytes become U+FFFD)."""
        text = self._emit(self._decoder.decode(b"", final=True))
        rest, self._held = self._held, ""
        return text + ("" if self.stopped else rest)

    def _emit(self, text: str) -> str:
        if self.stopped:
            return ""
        held = self._held + text
        hits = [(held.find(s), s) for s in self.stop if s in held]
        if hits:
            at, self.stopped = min(hits)
            self._held = ""
            return held[:at]
        keep = max((k for s in self.stop for k in range(min(len(s) - 1, len(held)), 0, -1)
                    if held.endswith(s[:k])), default=0)
        self._held = held[len(held) - keep:] if keep else ""
        return held[:len(held) - keep]


@dataclass
class Result:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)  # generated, without the final EOS
    text: str = ""
    stop_reason: str = "length"  # eos | stop | length | interrupted
    fed: int = 0  # how many of ``tokens`` went through the session (the last one sampled may not have)
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    prompt_route: str = ""  # the functions the prompt went through (prompt_route())

    def speeds(self) -> str:
        p, d = len(self.prompt_tokens), len(self.tokens) + (self.stop_reason == "eos")
        rate = lambda n, s: f"{n / s:.1f} tok/s" if s > 0 else "-"  # noqa: E731
        return (f"prompt: {p} tokens in {self.prompt_seconds:.2f} s ({rate(p, self.prompt_seconds)}, "
                f"{self.prompt_route}); decode: {d} tokens in {self.decode_seconds:.2f} s "
                f"({rate(d, self.decode_seconds)}); stopped: {self.stop_reason}")


def finite(session, logits: np.ndarray) -> np.ndarray:
    """``logits`` when every value is a number: NaN or infinite logits (a damaged lowered bundle)
    would be sampled as token 0 and end the text silently as if at end of text."""
    if not np.isfinite(logits).all():
        bad = int(np.count_nonzero(~np.isfinite(logits)))
        raise PipelineError(getattr(session, "aimodelx", "the bundle"), f"the Core AI runtime returned {bad} "
                            f"non-finite logits (NaN or infinite) of {logits.size}: the lowered bundle is damaged",
                            "rebuild it: snakemake --cores 1 --forcerun aot (and check the disk it is on)")
    return logits


def generate(session, tokenizer, prompt_tokens: Sequence[int], sampler: Sampler, max_new_tokens: int,
             stop: Sequence[str] = (), on_text: Callable[[str], None] = lambda _text: None,
             clock: Callable[[], float] = time.perf_counter,
             after_prompt: Callable[[], None] | None = None) -> Result:
    """Feed ``prompt_tokens``, then decode up to ``max_new_tokens``. ``session`` has ``step(token)``
    and maybe ``feed(tokens)`` (both return logits); ``on_text`` receives the text as it becomes final;
    ``after_prompt`` is called once the prompt is in the states (``--save-at prompt``)."""
    res = Result(list(prompt_tokens), prompt_route=prompt_route(session, len(prompt_tokens)))
    stream = TextStream(stop)
    context = list(prompt_tokens)
    pieces: list[str] = []

    def show(text: str) -> None:
        if text:
            pieces.append(text)
            on_text(text)

    t0 = clock()
    try:
        logits = finite(session, feed(session, prompt_tokens))
    except KeyboardInterrupt:  # during the prompt: nothing to show
        res.stop_reason, res.prompt_seconds = "interrupted", clock() - t0
        return res
    t1 = clock()
    res.prompt_seconds = t1 - t0
    if after_prompt is not None:
        after_prompt()
        t1 = clock()
    try:
        while len(res.tokens) < max_new_tokens:
            tok = sampler(logits, context)
            if tok == tokenizer.eos:
                res.stop_reason = "eos"
                break
            res.tokens.append(tok)
            context.append(tok)
            show(stream.push(tokenizer.token_bytes(tok)))
            if stream.stopped:
                res.stop_reason = "stop"
                break
            if len(res.tokens) < max_new_tokens:
                logits = finite(session, session.step(tok))
                res.fed += 1
    except KeyboardInterrupt:
        res.stop_reason = "interrupted"
    res.decode_seconds = clock() - t1
    show(stream.close())
    res.text = "".join(pieces)
    return res


def chat_tokens(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """The tokenizer kind's chat prompt (World: token 0, then ``User: …\\n\\nAssistant:``), or its
    start token then the raw text."""
    return tokenizer.prompt(prompt, chat)


def open_bundle(results: Path, model: str, recipe: str, use_prefill: bool = True, tokenizer_kind: str = "world",
                sampling: Sampling | None = None, family: str | None = None):
    """The runtime session over a recipe's lowered universal bundle — a :class:`PromptSession` when
    the bundle has a prefill function (and ``use_prefill``), else a :class:`DecodeSession` — and
    the model's tokenizer. The session is made from the bundle's runner contract, built from the
    stage records (:func:`bundle_contract`; ``session.contract``, ``session.identity``)."""
    aimodelx, contract, tokenizer = bundle_contract(results, model, recipe, tokenizer_kind, sampling, family)
    return session_from_contract(aimodelx, contract, use_prefill), tokenizer


def bundle_contract(results: Path, model: str, recipe: str, tokenizer_kind: str = "world",
                    sampling: Sampling | None = None, family: str | None = None):
    """(lowered bundle, runner contract, tokenizer) of a recipe's universal bundle, from the stage
    records, each checked; nothing loaded in the runtime yet. ``family`` names the states' meanings
    in the contract; ``sampling`` is checked against the bundle's logits (export.json)."""
    lay = Layout(results, model)
    aot_dir, vocab = lay.aot("universal", recipe), lay.vocab
    if not (aot_dir / AOT).is_file():
        raise PipelineError(aot_dir, f"no lowered bundle for {model}/{recipe}",
                            f"build it first: snakemake --cores 1 {aot_dir}")
    if not vocab.is_dir():
        raise PipelineError(vocab, "missing", f"build it first: snakemake --cores 1 {vocab}")
    # the bytes the export, aot and vocab stages recorded, before the runtime sees them
    record = read_export(lay.export(recipe))
    lowering = read_aot(aot_dir)
    vocab_files = read_vocab(vocab)
    if record["recipe"] != recipe or lowering["recipe"] != recipe or lowering["from"] != record["files"]:
        raise PipelineError(aot_dir, f"is not the lowering of {model}/{recipe}'s exported bundle (its aot.json names "
                            f"recipe {lowering['recipe']}, built from other bytes)" if lowering["from"] != record["files"]
                            else f"names recipe {lowering['recipe']}, the export {record['recipe']}, not {recipe}",
                            "rerun it: snakemake --cores 1 publish --forcerun aot")
    bundle_functions(record)  # an export from before the entry-point table: one line
    if sampling is not None:
        sampling.check(vocab=_logits_width(record["functions"]))
    tokenizer = tokenizers.kind(tokenizer_kind).load(vocab)
    contract = runner_contract.build(model, record, vocab, vocab_files, lowering["product"], tokenizer_kind, family,
                                     tokenizer)
    return aot_dir / lowering["product"], contract, tokenizer


def _logits_width(functions: dict) -> int | None:
    decode = next((f for f in functions.values() if f.get("role") == DECODE), {})
    logits = [t["shape"][-1] for t in decode.get("outputs", []) if t["name"] == "logits"]
    return int(logits[0]) if logits else None


def session_from_contract(aimodelx: Path, contract: dict, use_prefill: bool = True):
    """The runtime session a runner contract describes (its functions, roles and states), with
    ``contract`` and its state-file ``identity`` attached."""
    record = runner_contract.session_record(contract)
    functions = bundle_functions(record)
    if use_prefill and PREFILL in functions:
        session = PromptSession(aimodelx, record)
    else:
        session = DecodeSession(aimodelx, *state_spec(record), function=functions[DECODE]["name"],
                                expected=functions[DECODE])
    session.contract, session.identity = contract, runner_contract.identity(contract)
    return session


def open_folder(folder: Path, use_prefill: bool = True, sampling: Sampling | None = None):
    """(session, tokenizer) from a published bundle folder (``publish/universal/<bundle>/``):
    everything from its ``runner.json`` and ``tokenizer/`` -- no config, no stage records."""
    aimodelx, contract, tokenizer = folder_contract(folder, sampling)
    return session_from_contract(aimodelx, contract, use_prefill), tokenizer


def folder_contract(folder: Path, sampling: Sampling | None = None):
    """(lowered bundle, runner contract, tokenizer) of a published bundle folder, checked."""
    folder = Path(folder)
    contract = runner_contract.read(folder)
    asset = folder / contract["asset"]
    if asset.suffix != ".aimodelx":
        raise PipelineError(asset, "is not a universal lowering (.aimodelx), the form this host's Core AI runtime runs",
                            f"give the universal folder: {folder.parent.parent / 'universal' / folder.name}")
    tok_dir = folder / runner_contract.TOKENIZER_DIR
    files = {p.name: {"sha256": sha256_file(p), "size": p.stat().st_size} for p in sorted(tok_dir.iterdir())
             if p.is_file()} if tok_dir.is_dir() else {}
    if runner_contract.tokenizer_digest(files) != contract["tokenizer"]["sha256"]:
        raise PipelineError(tok_dir, f"does not hold the tokenizer files {runner_contract.CONTRACT} names (their digest "
                            "differs)", "download the bundle folder again")
    if sampling is not None:
        sampling.check(vocab=_logits_width(contract["functions"]))
    tokenizer = tokenizers.kind(contract["tokenizer"]["kind"]).load(tok_dir)
    return asset, contract, tokenizer


def save_state(session, path: str | Path, tokens: int) -> Path:
    """Save the session's states (after ``tokens`` tokens) to a state file (coreai/state_file.py).
    ``session`` is one :func:`open_bundle` or :func:`open_folder` made::

        session, tok = open_bundle(Path("results"), "rwkv7-tiny", "fp32")
        with session:
            ids = chat_tokens(tok, "You are a pirate.", chat=False)
            session.feed(ids)
            save_state(session, "pirate.state", len(ids))
    """
    return state_file.save(path, session.state_arrays(), session.identity, tokens)


def load_state(session, path: str | Path) -> int:
    """Load a state file into the session (refused in one line unless it fits the bundle); the
    number of tokens it holds. Feed the continuation next, without the start token
    (:func:`continuation_tokens`)."""
    arrays, tokens = state_file.load(path, session.identity, session.state_shapes, session.state_dtype)
    session.set_states(arrays)
    return tokens


def read_state(contract: dict, path: str | Path) -> tuple[dict, int]:
    """A state file checked against the bundle of ``contract`` before any runtime session exists:
    (the arrays, the tokens they hold); one line if it does not fit."""
    shapes, dtype = state_spec(runner_contract.session_record(contract))
    return state_file.load(path, runner_contract.identity(contract), shapes, dtype)


def tuned_state(contract: dict, path: str | Path) -> dict:
    """The initial states of a state-tuning file (BlinkDL's trainer, RWKV-PEFT: ``.pth`` or
    ``.safetensors`` holding ``blocks.<i>.att.time_state``) for the bundle of ``contract``, in its
    state dtype: ``session.set_states(tuned_state(session.contract, "role.pth"))``, then feed the
    prompt as usual (start token included). RWKV-6 and RWKV-7 only (``Family.tuned_states``)."""
    import numpy as np

    path = Path(path)
    if not path.is_file():
        raise PipelineError(path, "no such state-tuning file", "give the .pth the state-tuning trainer wrote")
    try:
        if path.suffix == ".safetensors":
            from safetensors.numpy import load_file

            tensors = load_file(path)
        else:
            import torch

            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch and safetensors raise many types for a damaged file
        raise PipelineError(path, f"cannot be read as a state-tuning file ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:120] if str(exc) else ''})",
                            "give the .pth the state-tuning trainer wrote (or a .safetensors of its tensors)") from None
    if not isinstance(tensors, dict):
        raise PipelineError(path, f"holds a {type(tensors).__name__}, not a dict of tensors",
                            "give the .pth the state-tuning trainer wrote")
    if not contract.get("family"):
        raise PipelineError(path, "cannot be placed: the runner contract names no family", "rebuild the contract")
    family = families.get(contract["family"])
    arrays = family.tuned_states(tensors, family.geometry_from_dict(contract["geometry"]), path)
    shapes, dtype = state_spec(runner_contract.session_record(contract))
    out = {n: np.asarray(a, dtype=dtype) for n, a in arrays.items()}
    if {n: tuple(a.shape) for n, a in out.items()} != {n: tuple(s) for n, s in shapes.items()}:
        raise PipelineError(path, "gives states that are not this bundle's", "give a state-tuning file of this model")
    if not all(np.isfinite(a).all() for a in out.values()):
        raise PipelineError(path, f"overflows this bundle's state dtype {dtype}", "use a recipe with float32 states")
    return out


def continuation_tokens(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """The prompt as :func:`chat_tokens` makes it, less the start ids every prompt begins with:
    what follows a loaded state."""
    head = len(tokenizer.prompt("", chat=False))
    return tokenizer.prompt(prompt, chat)[head:]


def parser() -> OneLineParser:
    p = OneLineParser(prog="python -m recurrent_coreai generate",
                      description="Generate text with a built bundle in the Core AI runtime.")
    p.add_argument("prompt", type=utf8_text)
    p.add_argument("--model", help="the model (with --recipe; or --bundle)")
    p.add_argument("--recipe")
    p.add_argument("--bundle", type=Path, help="a published bundle folder (publish/universal/<bundle>): run it from "
                   "its runner contract, without config or stage records")
    p.add_argument("--config-file", default=cfgmod.DEFAULT_FILE, help="where `results:` is read (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 (default): off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 (default): off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 (default): off")
    p.add_argument("--seed", type=int, help="seed for sampling (default: a fresh one, printed)")
    p.add_argument("--stop", action="append", type=utf8_text, help="stop string (repeatable); default: '\\n\\nUser:' in chat mode")
    p.add_argument("--no-chat", action="store_true", help="feed the prompt as plain text after token 0")
    p.add_argument("--main-only", action="store_true", help="feed the prompt through main even if prefill exists")
    p.add_argument("--save-state", type=Path, metavar="FILE", help="save the states to FILE (docs/tools.md#state-files)")
    p.add_argument("--save-at", choices=("prompt", "end"), default="prompt",
                   help="save after the prompt (default) or after the generated text")
    p.add_argument("--load-state", type=Path, metavar="FILE",
                   help="start from a saved state; the prompt continues it (fed without the start token)")
    p.add_argument("--state-tuning", type=Path, metavar="FILE",
                   help="start from an RWKV state-tuning file's trained initial state (.pth; RWKV-6, RWKV-7)")
    return p


def _check_args(ns) -> None:
    if ns.bundle is None and (ns.model is None or ns.recipe is None):
        raise PipelineError("generate", "names no bundle", "give --model M --recipe R, or --bundle FOLDER")
    if ns.bundle is not None and (ns.model is not None or ns.recipe is not None):
        raise PipelineError("--bundle", "is given with --model/--recipe", "give one of them: the folder names its model")
    if ns.max_new_tokens < 1:
        raise PipelineError("--max-new-tokens", f"{ns.max_new_tokens} is out of range", "use a positive count")
    if ns.seed is not None and not 0 <= ns.seed < 2**64:
        raise PipelineError("--seed", f"{ns.seed} is out of range", "use an integer from 0 to 2**64-1 "
                            "(or leave --seed out for a fresh one)")
    if ns.load_state is not None and ns.state_tuning is not None:
        raise PipelineError("--state-tuning", "is given with --load-state", "give one: both set the initial states")
    if ns.save_state is not None and not ns.save_state.parent.resolve().is_dir():
        raise PipelineError(ns.save_state, "its directory does not exist", "create it, or save the state elsewhere")
    if ns.save_state is not None and ns.save_state.is_dir():
        raise PipelineError(ns.save_state, "is a directory", "give a file name for the state")


@main_guard
def main(argv=None) -> int:
    ns = parser().parse_args(argv)
    _check_args(ns)
    sampler = Sampler(Sampling(ns.temperature, ns.top_k, ns.top_p, ns.repetition_penalty, ns.seed))
    if ns.bundle is not None:
        aimodelx, contract, tokenizer = folder_contract(ns.bundle, sampling=sampler.cfg)
    else:
        cfg = cfgmod.load_for_tool(ns.config_file)  # a --configfile fragment: merged over config.yaml
        model = cfgmod.model(cfg, ns.model)  # an unknown model or recipe is one line
        cfgmod.recipe(cfg, ns.recipe)
        kind = families.tokenizer_of(model, cfgmod.origin(cfg))
        aimodelx, contract, tokenizer = bundle_contract(Path(cfg["results"]), ns.model, ns.recipe, kind, sampler.cfg,
                                                        model["family"])
    stop = ns.stop if ns.stop is not None else ([] if ns.no_chat else list(contract["chat"]["stop"]))
    # every refusal before the runtime loads the bundle (its load lines go to stderr)
    arrays, held = read_state(contract, ns.load_state) if ns.load_state is not None else (None, 0)
    if ns.state_tuning is not None:
        arrays = tuned_state(contract, ns.state_tuning)
    try:
        prompt = (continuation_tokens if held else chat_tokens)(tokenizer, ns.prompt, chat=not ns.no_chat)
    except ValueError as exc:
        raise PipelineError("prompt", str(exc), "remove that character from the prompt") from None
    if not prompt:
        raise PipelineError("prompt", "is empty after the loaded state (no token to feed)",
                            "give the text that continues the saved state")
    out = sys.stdout.buffer

    def write(text: str) -> None:
        out.write(text.encode("utf-8"))
        out.flush()

    session = session_from_contract(aimodelx, contract, use_prefill=not ns.main_only)
    with session:
        if arrays is not None:
            session.set_states(arrays)
        if not sampler.cfg.greedy:
            print(f"sampling: seed {sampler.seed}", file=sys.stderr)
        after_prompt = None
        if ns.save_state is not None and ns.save_at == "prompt":
            def after_prompt() -> None:
                save_state(session, ns.save_state, held + len(prompt))
        res = generate(session, tokenizer, prompt, sampler, ns.max_new_tokens, stop, write, after_prompt=after_prompt)
        if ns.save_state is not None and ns.save_at == "end" and res.stop_reason != "interrupted":
            for tok in res.tokens[res.fed:]:  # the states hold every generated token before they are saved
                finite(session, session.step(tok))
            save_state(session, ns.save_state, held + len(prompt) + len(res.tokens))
    write("\n")
    print(res.speeds(), file=sys.stderr)
    if ns.save_state is not None and res.stop_reason != "interrupted":
        print(f"state: {held + len(prompt) + (len(res.tokens) if ns.save_at == 'end' else 0)} tokens saved to "
              f"{ns.save_state}", file=sys.stderr)
    return 130 if res.stop_reason == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(main())
