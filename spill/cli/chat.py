"""``spill chat MODEL [--adapter A]``: talk to a model in a terminal (``spill.jobs.chat``).

A line read after the ``> `` prompt is the next user turn; the reply is printed token by token
as it is generated. ``/reset`` forgets the conversation; end of input (Ctrl-D) leaves with exit
0; Ctrl-C during a reply stops that reply (what was shown stays in the conversation), at the
prompt it leaves. A message that would take the conversation past the model's context is
refused in one line and the chat goes on (exit 1 at the end, so a script sees it); a line over
``LINE_MAX`` bytes or not UTF-8 ends the chat in one line (exit 1).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from spill.cli.options import engine_options, engine_settings, model_options, model_settings
from spill.errors import DataError, TokenizerError

HELP = "talk to a model (and adapter) in the terminal, the reply streamed as it is generated"
PROMPT = "> "
LINE_MAX = 1 << 20  # bytes a line may have: a message, not a file (its memory stays bounded)


def _say(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _read_line(stream, lineno: int) -> str | None:
    """The next line of ``stream`` (bytes) without its newline; None at the end of input. A
    line past ``LINE_MAX`` bytes, or not UTF-8, is no message: one line says so."""
    raw = stream.readline(LINE_MAX + 1)
    if not raw:
        return None
    if len(raw) > LINE_MAX:
        raise DataError(
            f"stdin: line {lineno} is longer than {LINE_MAX // 2**20} MiB; spill chat takes "
            "messages, not files: send a shorter one"
        )
    try:
        return raw.decode("utf-8").removesuffix("\n")
    except UnicodeDecodeError:
        raise DataError(
            f"stdin: line {lineno} is not UTF-8 text; spill chat takes typed text, not binary input"
        ) from None


def cmd_chat(args) -> int:
    from spill.jobs.chat import open_chat
    from spill.models.quant import spec_of

    adapter = Path(args.adapter) if args.adapter else None
    quantize = spec_of(model_settings(args))
    engine = engine_settings(args)
    chat = open_chat(args.model, adapter, engine, args.weights, args.max_new_tokens, quantize)
    print("/reset forgets the conversation, Ctrl-D leaves, Ctrl-C stops a reply", file=sys.stderr)
    stopped, refused = [False], False

    def interrupt(signum, frame) -> None:
        stopped[0] = True

    try:
        lineno = 0
        while True:
            lineno += 1
            _say(PROMPT)
            line = _read_line(sys.stdin.buffer, lineno)
            if line is None:
                _say("\n")
                return 1 if refused else 0
            if not line.strip():
                continue
            if line.strip() == "/reset":
                chat.reset()
                _say("(conversation cleared)\n")
                continue
            stopped[0] = False
            before = signal.signal(signal.SIGINT, interrupt)
            try:
                _, finish = chat.reply(line, _say, lambda: stopped[0])
            except (DataError, TokenizerError) as e:  # this turn only: the conversation goes on
                print(f"spill: error: {e}", file=sys.stderr)
                refused = True
                continue
            finally:
                signal.signal(signal.SIGINT, before)
            _say(" [stopped]\n" if finish == "cancelled" else "\n")
    finally:
        chat.close()


def add_parser(sub, full: bool = True) -> None:
    """``full=False`` (another verb runs): the name and help only, no conf defaults read."""
    if not full:
        sub.add_parser("chat", help=HELP)
        return
    p = sub.add_parser(
        "chat",
        help=HELP,
        description="An interactive conversation with MODEL (with --adapter, a LoRA adapter "
        "folder such as a built project's .spill/adapters/<name>/), rendered with the model's "
        "chat template and answered greedily. /reset forgets the conversation; Ctrl-D leaves "
        "(exit 0); Ctrl-C during a reply stops that reply.",
    )
    p.add_argument("model", help="alias (smollm2:135m), hub id or local model folder")
    p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter folder (spill or PEFT layout)")
    p.add_argument(
        "--max-new-tokens", type=int, default=256, metavar="N", help="longest reply (256)"
    )
    engine_options(p)
    model_options(p)
    p.set_defaults(func=cmd_chat)
