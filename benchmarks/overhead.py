"""Share of a greedy `none` generation spent outside the target model's forward calls
(proposing, verifying, cache bookkeeping, stop checks): wraps `model.forward` with a timer.

    python benchmarks/overhead.py MODEL [NEW_TOKENS] [REPEATS]
"""

import sys
import time

import speclm


def main() -> None:
    name, new_tokens, repeats = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 32, int(sys.argv[3]) if len(sys.argv) > 3 else 3
    target = speclm.load_model(name, progress=False)
    engine = speclm.SpecEngine(target)
    ids = engine.encode(["Explain how a hash map works, in detail."], chat=True)[0]
    inner, spent = target.model.forward, []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        spent.append(time.perf_counter() - start)
        return out

    target.model.forward = timed
    engine.generate(ids, max_new_tokens=4)  # warm-up
    for _ in range(repeats):
        spent.clear()
        start = time.perf_counter()
        out = engine.generate(ids, max_new_tokens=new_tokens)
        wall = time.perf_counter() - start
        print(f"{name}: {len(out.token_ids)} tokens, wall {wall:.3f} s, in target forward {sum(spent):.3f} s, "
              f"outside {100 * (1 - sum(spent) / wall):.2f}%")


if __name__ == "__main__":
    main()
