"""Write the length files the README's "Microbatches of different lengths" example uses.

Deterministic (a fixed seed; Python's Mersenne Twister and its log-normal draw are stable
across versions), so the committed files can be re-derived: `python3 bench/lengths/make.py`.

- `chat-8k.txt`: supervised fine-tuning on chat data. Conversation lengths are log-normal
  (median 700 tokens, a long tail; clipped to 32..8192), packed in arrival order into
  microbatches of at most 8192 tokens (a conversation that does not fit starts the next
  microbatch): 64 microbatches, each line the conversations packed into it.
- `long-mix.txt`: a long-context mix. Three microbatches in four are packed chat data as
  above; one in four is a single long document of 16k-32k tokens. 64 microbatches.
"""

import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def conversations(rng: random.Random):
    while True:
        yield min(8192, max(32, round(rng.lognormvariate(6.55, 0.9))))


def packed(rng: random.Random, cap: int = 8192):
    docs = conversations(rng)
    line: list[int] = []
    for d in docs:
        if line and sum(line) + d > cap:
            yield line
            line = []
        line.append(d)


def main() -> None:
    rng = random.Random(38)
    chat = packed(rng)
    lines = [next(chat) for _ in range(64)]
    write("chat-8k.txt", lines)
    rng = random.Random(3838)
    chat = packed(rng)
    mix = []
    for i in range(64):
        if rng.random() < 0.25:
            mix.append([rng.randrange(16384, 32769)])
        else:
            mix.append(next(chat))
    write("long-mix.txt", mix)


def write(name: str, lines: list[list[int]]) -> None:
    text = "".join(" ".join(str(x) for x in line) + "\n" for line in lines)
    (HERE / name).write_text(text)


if __name__ == "__main__":
    main()
