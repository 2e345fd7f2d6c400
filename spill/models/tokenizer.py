"""Text <-> token ids through the ``tokenizers`` library, plus the model's chat template.

The template is rendered with a sandboxed Jinja environment configured as transformers does,
so a template copied from a hub model renders the same text here, and bounded in size and time
(``spill.models.chat_template``): a template that passes a bound fails in one line. Rendered
chat text already carries its special tokens, so it is encoded without adding more.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

from spill.errors import TokenizerError


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, folder: Path):
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(
                f"{path}: no tokenizer.json in the model folder; re-import or re-download the model"
            )
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise TokenizerError(
                f"{path}: unreadable tokenizer ({str(e).splitlines()[0]}); re-import or re-download the model"
            ) from None
        self.folder = folder
        self._config = self._read_json(folder / "tokenizer_config.json")
        gen = self._read_json(folder / "generation_config.json")
        cfg = self._read_json(folder / "config.json")
        self.bos_token = _token_text(self._config.get("bos_token"))
        self.eos_token = _token_text(self._config.get("eos_token"))
        eos = set()
        for source in (gen.get("eos_token_id"), cfg.get("eos_token_id")):
            eos.update(
                source if isinstance(source, list) else [source] if source is not None else []
            )
        if self.eos_token is not None and self.token_id(self.eos_token) is not None:
            eos.add(self.token_id(self.eos_token))
        self.eos_ids = tuple(sorted(eos))
        pad = self._config.get("pad_token")
        pad_id = self.token_id(_token_text(pad)) if pad else None
        self.pad_id = pad_id if pad_id is not None else (self.eos_ids[0] if self.eos_ids else 0)

    @staticmethod
    def _read_json(path: Path) -> dict:
        if not path.is_file():
            return {}
        try:
            return json.loads(path.read_bytes())  # bytes: the same reading as load_config's
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise TokenizerError(
                f"{path}: not valid JSON; re-import or re-download the model"
            ) from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self._tok.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def chat_template(self) -> str | None:
        jinja = self.folder / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        template = self._config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None:
            template = self._read_json(self.folder / "chat_template.json").get("chat_template")
        return template

    @cached_property
    def _template(self):
        """The chat template, compiled once (``spill.models.chat_template``: bounded renders)."""
        from spill.models.chat_template import ChatTemplate

        return ChatTemplate(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise TokenizerError(
                f"{self.folder}: the model has no chat template; give rows a 'prompt' instead of 'messages'"
            )
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except RecursionError:
            why = "it recurses too deeply"
        except MemoryError:
            why = "it ran out of memory"
        except Exception as e:  # the template is someone else's code: any failure is one line
            from jinja2 import TemplateError

            text = " ".join(str(e).split()) or "no message"
            why = text if isinstance(e, TemplateError) else f"{type(e).__name__}: {text}"
        raise TokenizerError(
            f"{self.folder}: chat template failed: {why[:300]}; fix or replace the model's chat template"
        ) from None

    @cached_property
    def longest_token(self) -> int:
        """Characters of the vocabulary's longest entry: a text's last ``n`` tokens lie
        within its last ``n`` times this many characters."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode_last(
        self, text: str, most: int, add_special_tokens: bool = True
    ) -> tuple[list[int], bool]:
        """The last ``most`` tokens of ``text`` and whether any were cut. Only the tail that
        can hold them is encoded, so a text of any length costs memory in proportion to
        ``most`` (the first of them may then differ from the whole text's encoding)."""
        span = (most + 1) * self.longest_token
        cut = len(text) > span
        ids = self.encode(text[-span:] if cut else text, add_special_tokens)
        return ids[-most:], cut or len(ids) > most

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        )
