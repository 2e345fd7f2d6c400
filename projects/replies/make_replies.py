"""Writes replies.csv: preference pairs made from ../tickets/tickets.csv.

Each ticket gets a short first reply from support. The chosen reply hands the ticket to the team
its label names; the rejected one hands it to another team, picked by a seeded draw, in the very
same words. So the only thing DPO can learn from a pair is which team a ticket belongs to, and a
model's preference accuracy (the chosen reply scored above the rejected one) measures exactly that.

    python projects/replies/make_replies.py
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEAMS = {
    "account_access": "the account team",
    "billing": "the billing team",
    "cancellation": "the cancellations team",
    "feedback": "the product feedback team",
    "product_question": "the product specialists",
    "returns": "the returns team",
    "shipping": "the shipping team",
    "technical_bug": "the engineering team",
}


def reply(team: str) -> str:
    return f"Thanks for writing in. I am passing this to {team}, who will reply today."


def main() -> None:
    rng = random.Random(0)
    with open(HERE.parent / "tickets" / "tickets.csv", newline="", encoding="utf-8") as f:
        tickets = list(csv.DictReader(f))
    rows = []
    for t in tickets[:240]:
        right = TEAMS[t["label"]]
        wrong = rng.choice([team for label, team in TEAMS.items() if label != t["label"]])
        rows.append({"ticket": t["text"], "good": reply(right), "bad": reply(wrong)})
    with open(HERE / "replies.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=["ticket", "good", "bad"])
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {len(rows)} pairs to {HERE / 'replies.csv'}")


if __name__ == "__main__":
    main()
