"""Write toy.csv: four keywords among distractor words decide a short label.

Each row is three distractor words and one keyword in a random position; the label is the
keyword's (apple -> red, tiger -> big, piano -> low, rocket -> hot). A random tiny model does
not know this (base score near 0); a LoRA adapter learns it from the training split.

    python projects/toy/make_data.py > projects/toy/toy.csv
"""

import csv
import random
import sys

KEYWORDS = {"apple": "red", "tiger": "big", "piano": "low", "rocket": "hot"}
FILLER = "blue stone river cloud green table window paper light sand moon grass chair road"


def rows(n: int = 400, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        keyword = rng.choice(sorted(KEYWORDS))
        words = rng.sample(FILLER.split(), 3)
        words.insert(rng.randrange(4), keyword)
        out.append((" ".join(words), KEYWORDS[keyword]))
    return out


if __name__ == "__main__":
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(["text", "label"])
    writer.writerows(rows())
