"""A conversation with a model (``spill chat``, ``open_chat``): the turns so far, and each reply
streamed (``Conversation``).

Every reply renders the whole conversation with the model's chat template and generates greedily
through the runner's one generation loop (``Runner.generate(on_token=...)``). A reply cut short
(``stop()`` true) keeps what was shown as its turn. A turn whose conversation and reply would pass
the model's context is refused (``DataError``) before anything is generated, and not kept; only the
tail that could fit is ever encoded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from spill.engines.base import GenerateParams
from spill.errors import DataError
from spill.jobs.adapter_files import apply_adapter, load_adapter
from spill.jobs.loading import LoadedModel, find_model, open_model
from spill.models.quant import Spec
from spill.settings import EngineSettings
from spill.store import drill


# The text shown is the decoded reply so far, less what was already shown; a tail that decodes to
# U+FFFD (a character cut between byte tokens) waits for the next token.
class Conversation:
    def __init__(self, loaded: LoadedModel, max_new_tokens: int) -> None:
        if not loaded.tokenizer.chat_template:
            raise DataError(f"{loaded.name} has no chat template; spill chat needs a chat model")
        if max_new_tokens >= loaded.context:
            raise DataError(
                f"--max-new-tokens {max_new_tokens} leaves no room for a conversation in the "
                f"model's context of {loaded.context} tokens; lower it"
            )
        self.loaded, self.max_new_tokens = loaded, max_new_tokens
        self.room = loaded.context - max_new_tokens  # tokens the conversation may take
        self.messages: list[dict[str, str]] = []

    def reset(self) -> None:
        self.messages = []

    def reply(
        self, text: str, show: Callable[[str], None], stop: Callable[[], bool] = lambda: False
    ) -> tuple[str, str]:
        """Answer the user's ``text`` after the turns so far, ``show``-ing the reply as it
        grows; returns (the reply, how it finished: stop, length or cancelled)."""
        tok = self.loaded.tokenizer
        turns = [*self.messages, {"role": "user", "content": text}]
        ids, long = tok.encode_last(tok.apply_chat_template(turns), self.room, False)
        if long:  # refused before the model sees it: the turn is not kept
            raise DataError(
                f"this message brings the conversation past the {self.room} tokens the model's "
                f"context ({self.loaded.context}) leaves beside a reply of up to "
                f"{self.max_new_tokens}; send a shorter one, or /reset"
            )
        prompt = np.asarray(ids, dtype=np.int64)
        params = GenerateParams(self.max_new_tokens, 0.0, 1.0, tuple(tok.eos_ids))
        ids: list[int] = []
        shown = [""]

        def on_token(row: int, token: int) -> bool:
            ids.append(token)
            now = tok.decode(ids)
            if not now.endswith("\ufffd") and now.startswith(shown[0]):
                show(now[len(shown[0]) :])
                shown[0] = now
            drill.at(drill.CHAT_TOKEN)
            return stop()

        (gen,) = self.loaded.runner.generate([prompt], params, [0], on_token=on_token)
        answer = tok.decode(gen.tokens)
        if answer.startswith(shown[0]) and answer != shown[0]:
            show(answer[len(shown[0]) :])
        self.messages = [*turns, {"role": "assistant", "content": answer}]
        return answer, gen.finish

    def close(self) -> None:
        self.loaded.runner.close()


def open_chat(
    model: str,
    adapter: Path | None,
    engine: EngineSettings,
    weights: str | None,
    max_new_tokens: int,
    quantize: Spec | None = None,
) -> Conversation:
    """A model (and LoRA adapter) opened for a conversation, with the pre-run line;
    ``quantize``: on the model's quantized copy (made on first use)."""
    if max_new_tokens < 1:
        raise DataError("--max-new-tokens must be at least 1")
    lora = load_adapter(adapter) if adapter else None
    resolved, fp = find_model(model, weights, quantize)
    name = model if quantize is None else resolved.name
    loaded = open_model(name, resolved, fp, engine.name, engine, "chat")
    try:
        apply_adapter(loaded, lora)
        return Conversation(loaded, max_new_tokens)
    except BaseException:
        loaded.runner.close()
        raise
