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
from recurrent_coreai.coreai.runtime import DecodeSession, PromptSession, state_spec
from recurrent_coreai.coreai.entrypoints import DECODE, PREFILL, bundle_functions
from recurrent_coreai.util.errors import PipelineError, main_guard
from recurrent_coreai.pipeline.paths import Layout
from recurrent_coreai.pipeline.records import AOT, read_aot, read_export, read_vocab
from recurrent_coreai.tools.one_line_parser import OneLineParser, utf8_text
from recurrent_coreai.tools.sampling import Sampler, Sampling
from recurrent_coreai import families, tokenizers

DEFAULT_STOP = ("\n\nUser:",)  # the chat format's next turn: the model would go on playing the user


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
             clock: Callable[[], float] = time.perf_counter) -> Result:
    """Feed ``prompt_tokens``, then decode up to ``max_new_tokens``. ``session`` has ``step(token)``
    and maybe ``feed(tokens)`` (both return logits); ``on_text`` receives the text as it becomes final."""
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
                sampling: Sampling | None = None):
    """The runtime session over a recipe's lowered universal bundle — a :class:`PromptSession` when
    the bundle has a prefill function (and ``use_prefill``), else a :class:`DecodeSession` — and
    the model's tokenizer. ``sampling`` is checked against the bundle's logits (export.json) before
    the runtime loads it."""
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
    read_vocab(vocab)
    if record["recipe"] != recipe or lowering["recipe"] != recipe or lowering["from"] != record["files"]:
        raise PipelineError(aot_dir, f"is not the lowering of {model}/{recipe}'s exported bundle (its aot.json names "
                            f"recipe {lowering['recipe']}, built from other bytes)" if lowering["from"] != record["files"]
                            else f"names recipe {lowering['recipe']}, the export {record['recipe']}, not {recipe}",
                            "rerun it: snakemake --cores 1 publish --forcerun aot")
    aimodelx = aot_dir / lowering["product"]
    functions = bundle_functions(record)
    if sampling is not None:
        logits = [t["shape"][-1] for t in functions[DECODE].get("outputs", []) if t["name"] == "logits"]
        sampling.check(vocab=int(logits[0]) if logits else None)
    tokenizer = tokenizers.kind(tokenizer_kind).load(vocab)
    if use_prefill and PREFILL in functions:
        return PromptSession(aimodelx, record), tokenizer
    return DecodeSession(aimodelx, *state_spec(record), function=functions[DECODE]["name"],
                         expected=functions[DECODE]), tokenizer


def parser() -> OneLineParser:
    p = OneLineParser(prog="python -m recurrent_coreai generate",
                      description="Generate text with a built bundle in the Core AI runtime.")
    p.add_argument("prompt", type=utf8_text)
    p.add_argument("--model", required=True)
    p.add_argument("--recipe", required=True)
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
    return p


@main_guard
def main(argv=None) -> int:
    ns = parser().parse_args(argv)
    cfg = cfgmod.load(ns.config_file)
    cfgmod.model(cfg, ns.model)  # an unknown model or recipe is one line
    cfgmod.recipe(cfg, ns.recipe)
    if ns.max_new_tokens < 1:
        raise PipelineError("--max-new-tokens", f"{ns.max_new_tokens} is out of range", "use a positive count")
    if ns.seed is not None and not 0 <= ns.seed < 2**64:
        raise PipelineError("--seed", f"{ns.seed} is out of range", "use an integer from 0 to 2**64-1 "
                            "(or leave --seed out for a fresh one)")
    sampler = Sampler(Sampling(ns.temperature, ns.top_k, ns.top_p, ns.repetition_penalty, ns.seed))
    stop = ns.stop if ns.stop is not None else ([] if ns.no_chat else list(DEFAULT_STOP))
    kind = families.tokenizer_of(cfgmod.model(cfg, ns.model), cfgmod.origin(cfg))
    session, tokenizer = open_bundle(Path(cfg["results"]), ns.model, ns.recipe, use_prefill=not ns.main_only,
                                     tokenizer_kind=kind, sampling=sampler.cfg)
    try:
        prompt = chat_tokens(tokenizer, ns.prompt, chat=not ns.no_chat)
    except ValueError as exc:
        raise PipelineError("prompt", str(exc), "remove that character from the prompt") from None
    out = sys.stdout.buffer

    def write(text: str) -> None:
        out.write(text.encode("utf-8"))
        out.flush()

    if not sampler.cfg.greedy:
        print(f"sampling: seed {sampler.seed}", file=sys.stderr)
    with session:
        res = generate(session, tokenizer, prompt, sampler, ns.max_new_tokens, stop, write)
    write("\n")
    print(res.speeds(), file=sys.stderr)
    return 130 if res.stop_reason == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(main())
