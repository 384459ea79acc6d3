"""A batch of 64 programs that share a few-shot prefix.

run_batch traces the program to find its constant prefix (the instructions and the examples),
prefills it once, then runs the 64 programs concurrently on one event loop. Each program's
prompt starts with that prefix, so it is read from the radix cache instead of being computed 64
times.

    python examples/batch_prefix.py
"""
import time

import stemma

TOPICS = [" sports", " science", " business", " food"]
SHOTS = [
    ("The striker scored twice in the cup final.", " sports"),
    ("Astronomers found water vapour on a distant planet.", " science"),
    ("The bank raised interest rates by half a point.", " business"),
    ("This soup recipe needs only five ingredients.", " food"),
    ("The tennis champion retired after twenty years.", " sports"),
    ("A new battery design charges in five minutes.", " science"),
    ("Shares of the car maker fell after weak sales.", " business"),
    ("The bakery is famous for its sourdough bread.", " food"),
]
SUBJECTS = {
    " sports": ["The goalkeeper", "The marathon runner", "The basketball team", "The cyclist"],
    " science": ["The physicists", "A team of biologists", "The space probe", "Chemists"],
    " business": ["The retailer", "The oil company", "Investors", "The startup"],
    " food": ["The chef", "The new restaurant", "This pasta dish", "The chocolate cake"],
}
EVENTS = {
    " sports": ["won the championship", "broke the world record", "lost the match", "signed a new coach"],
    " science": ["discovered a new particle", "mapped the genome", "measured the magnetic field",
                 "published the experiment"],
    " business": ["reported record profits", "cut its prices", "bought a rival firm", "hired a new CEO"],
    " food": ["tastes of fresh herbs", "serves spicy noodles", "uses local cheese", "needs only sugar and eggs"],
}


@stemma.function
def topic(s, headline):
    s += "Label each headline with its topic: sports, science, business or food.\n\n"
    for text, label in SHOTS:
        s += f"Headline: {text}\nTopic:{label}\n\n"
    s += f"Headline: {headline}\nTopic:"
    s += stemma.select("topic", TOPICS)


def headlines():
    out = []
    for label in TOPICS:
        for subject in SUBJECTS[label]:
            for event in EVENTS[label]:
                out.append((f"{subject} {event}.", label))
    return out  # 4 topics x 4 subjects x 4 events = 64


def main():
    batch = headlines()
    start = time.perf_counter()
    states = topic.run_batch([{"headline": h} for h, _ in batch], max_concurrency=64, progress_bar=True)
    elapsed = time.perf_counter() - start
    correct = sum(s["topic"] == label for s, (_, label) in zip(states, batch))
    for (headline, label), state in list(zip(batch, states))[::9]:
        print(f"{state['topic'].strip():9} (true:{label}) {headline}")
    prefix = states.prefill.prompt_tokens
    served = sum(min(s.calls()[0].cached_tokens, prefix) for s in states)
    print(f"\n{correct}/{len(batch)} labelled correctly in {elapsed:.1f} s")
    print(f"shared prefix: {prefix} tokens, prefilled once; the 64 programs read "
          f"{served / (len(batch) * prefix):.0%} of their prefix tokens from the cache")
    print(f"all calls: {states.usage()}")


if __name__ == "__main__":
    main()
