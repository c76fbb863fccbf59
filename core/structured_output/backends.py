"""The grammar backends behind one matcher interface: xgrammar (the default) and llguidance (JSON schemas with
keywords xgrammar cannot enforce). Both fill the same packed int32 bitmask rows."""
from __future__ import annotations

import json
import re
import threading
from typing import Any, Protocol

import numpy as np
import xgrammar

from core.structured_output.formats import with_exact_formats
from core.structured_output.routing import json_schema_backend
from ipc import StructuredOutputsParams

# xgrammar prefixes its messages with "[time] /path/file.cc:line: "; a client needs only what follows.
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class RequestGrammar(Protocol):
    """One request's place in its grammar. Once the grammar is complete only stop tokens are allowed; the
    request ends when one is accepted (even under ignore_eos)."""

    def accept(self, token_id: int) -> bool: ...

    @property
    def is_terminated(self) -> bool: ...

    def fill(self, bitmask: np.ndarray, row: int) -> None: ...

    def fork(self) -> RequestGrammar:
        """An independent copy at the same place (a multi-step call advances one by the tokens it samples)."""


class CompiledConstraint(Protocol):
    def matcher(self, stop_token_ids: list[int]) -> RequestGrammar: ...

    @property
    def size_bytes(self) -> int: ...


class Backends:
    """Compiles a constraint with the backend that can enforce it; each backend's vocabulary tables are built on
    first use. Called from the compiling threads."""

    def __init__(self, tokenizer_dir: str, vocab_size: int) -> None:
        self.tokenizer_dir, self.vocab_size = tokenizer_dir, vocab_size
        self._tokenizer: Any = None
        self._xgrammar: xgrammar.GrammarCompiler | None = None
        self._info: xgrammar.TokenizerInfo | None = None
        self._guidance: Any = None
        self._tables_lock = threading.RLock()  # the vocabulary tables are built once, by whichever thread is first

    def build_tables(self) -> None:
        """Both backends' vocabulary tables (seconds for a large vocabulary), before any compile needs them."""
        self._xgrammar_compiler()
        self._guidance_tokenizer()

    def compile(self, params: StructuredOutputsParams) -> CompiledConstraint:
        """The compiled constraint, or ValueError with the backend's own message (also for a constraint that allows
        no output at all, such as rules or $refs that only lead to each other)."""
        schema = with_exact_formats(params.spec) if params.kind == "json" else '{"type": "object"}'
        if params.kind == "json" and json_schema_backend(json.loads(schema)) == "guidance":
            compiled = self._compile_guidance(schema, params.disable_any_whitespace)
        else:
            try:
                compiled = _XGrammarCompiled(self._compile_xgrammar(params, schema))
            except (RuntimeError, ValueError, TypeError) as error:
                raise ValueError(f"structured_outputs.{params.kind} could not be compiled: "
                                 f"{_LOCATION.sub('', str(error)).strip()}") from None
        self._check_allows_output(compiled, params)
        return compiled

    def _check_allows_output(self, compiled: CompiledConstraint, params: StructuredOutputsParams) -> None:
        row = np.zeros((1, (self.vocab_size + 31) // 32), dtype=np.int32)
        compiled.matcher([]).fill(row, 0)
        if not row.any():
            raise ValueError(f"structured_outputs.{params.kind} allows no output at all: no token can begin it "
                             "(rules or $refs that only lead to each other, with no way out)")

    def export(self, compiled: CompiledConstraint) -> tuple[str, bytes]:
        """(backend, payload) from which `restore` rebuilds the constraint in another process: xgrammar's serialized
        grammar; nothing for llguidance, whose matcher is rebuilt from the schema in milliseconds."""
        if isinstance(compiled, _XGrammarCompiled):
            return "xgrammar", compiled.compiled.serialize_json().encode()
        return "guidance", b""

    def restore(self, params: StructuredOutputsParams, backend: str, payload: bytes) -> CompiledConstraint:
        if backend == "xgrammar":
            self._xgrammar_compiler()
            return _XGrammarCompiled(xgrammar.CompiledGrammar.deserialize_json(payload.decode(), self._info))
        return self._compile_guidance(with_exact_formats(params.spec), params.disable_any_whitespace)

    def _compile_xgrammar(self, params: StructuredOutputsParams, schema: str) -> xgrammar.CompiledGrammar:
        compiler = self._xgrammar_compiler()
        if params.kind in ("json", "json_object"):
            return compiler.compile_json_schema(schema, any_whitespace=not params.disable_any_whitespace)
        if params.kind == "regex":
            return compiler.compile_regex(params.regex)
        if params.kind == "choice":
            return compiler.compile_grammar(choice_grammar(params.choice))
        if params.kind == "structural_tag":
            return compiler.compile_structural_tag(params.structural_tag)
        return compiler.compile_grammar(params.grammar)

    def _compile_guidance(self, schema: str, disable_any_whitespace: bool) -> CompiledConstraint:
        import llguidance

        options = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False} \
            if disable_any_whitespace else {"whitespace_flexible": True}  # as xgrammar writes JSON
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        template = llguidance.LLMatcher(self._guidance_tokenizer(), grammar)
        if template.is_error():
            raise ValueError(f"structured_outputs.json could not be compiled: {template.get_error()}")
        return _GuidanceCompiled(template, self._hf_tokenizer().eos_token_id, len(schema))

    def _hf_tokenizer(self) -> Any:
        """The vocabulary's token strings come from the tokenizer files (the engine never tokenizes text)."""
        with self._tables_lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
            return self._tokenizer

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._tables_lock:
            if self._xgrammar is None:
                self._info = xgrammar.TokenizerInfo.from_huggingface(self._hf_tokenizer(), vocab_size=self.vocab_size)
                self._xgrammar = xgrammar.GrammarCompiler(self._info, max_threads=1)
            return self._xgrammar

    def _guidance_tokenizer(self) -> Any:
        with self._tables_lock:
            if self._guidance is None:
                import llguidance.hf

                self._guidance = llguidance.hf.from_tokenizer(self._hf_tokenizer(), n_vocab=self.vocab_size)
            return self._guidance


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the choices (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


class _XGrammarCompiled:
    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        self.compiled = compiled
        self.size_bytes = compiled.memory_size_bytes

    def matcher(self, stop_token_ids: list[int]) -> RequestGrammar:
        return _XGrammarMatcher(xgrammar.GrammarMatcher(self.compiled, override_stop_tokens=stop_token_ids or None))


class _XGrammarMatcher:
    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def fork(self) -> RequestGrammar:
        return _XGrammarMatcher(self.matcher.fork())


class _GuidanceCompiled:
    """llguidance ends a grammar with the tokenizer's EOS token (a request's other stop ids are not offered)."""

    def __init__(self, template: Any, eos_token_id: int | None, schema_chars: int) -> None:
        self.template, self.eos_token_id = template, eos_token_id
        self.size_bytes = 64 * schema_chars  # an estimate: llguidance reports no size; its lexer grows as it runs

    def matcher(self, stop_token_ids: list[int]) -> RequestGrammar:
        return _GuidanceMatcher(self.template.deep_copy(), self.eos_token_id)


class _GuidanceMatcher:
    def __init__(self, matcher: Any, eos_token_id: int | None) -> None:
        self.matcher, self.eos_token_id = matcher, eos_token_id
        self.ended = False

    def accept(self, token_id: int) -> bool:
        accepted = self.matcher.consume_token(token_id)
        # llguidance stops as soon as only EOS can follow; the request ends on the EOS itself, as under xgrammar,
        # so that its last token is a stop token (whose text the front end leaves out), never content.
        self.ended = accepted and token_id == self.eos_token_id and self.matcher.is_stopped()
        return accepted

    @property
    def is_terminated(self) -> bool:
        return self.ended

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(self.matcher, bitmask, row)

    def fork(self) -> RequestGrammar:
        fork = _GuidanceMatcher(self.matcher.deep_copy(), self.eos_token_id)
        fork.ended = self.ended
        return fork
