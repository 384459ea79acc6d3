"""Few-shot sentiment classification with `select`.

Every review is its own program; they all start with the same few-shot prefix, which run_batch
prefills once. `select` scores both labels in one batched request over the shared prefix and
returns the scores beside the choice.

    python examples/few_shot_select.py
"""
import stemma

SHOTS = [
    ("The food was delicious and the staff were lovely.", "positive"),
    ("I waited an hour and the soup was cold.", "negative"),
    ("Best concert I have been to in years!", "positive"),
    ("The battery died after two days. Waste of money.", "negative"),
    ("A warm, funny film that the whole family enjoyed.", "positive"),
    ("Rude driver, dirty bus, and we arrived late.", "negative"),
]

REVIEWS = [
    "Absolutely loved the hotel, the view was stunning.",
    "The package arrived broken and support never answered.",
    "Great value, I would buy it again.",
    "Terrible acting and a boring plot.",
    "The coffee was fantastic and the barista was friendly.",
    "My order was wrong twice and nobody apologized.",
]


@stemma.function
def classify(s, review):
    s += "Classify the sentiment of each review as positive or negative.\n\n"
    for text, label in SHOTS:
        s += f"Review: {text}\nSentiment: {label}\n\n"
    s += f"Review: {review}\nSentiment:"
    s += stemma.select("label", [" positive", " negative"])


def main():
    states = classify.run_batch([{"review": r} for r in REVIEWS], progress_bar=True)
    for review, state in zip(REVIEWS, states):
        scores = state.meta("label").scores
        print(f"{state['label'].strip():8}  (positive {scores[0]:6.2f}, negative {scores[1]:6.2f})  {review}")
    print(f"\nshared prefix: {states.prefill.prompt_tokens} tokens, prefilled once")
    print(f"all calls: {states.usage()}")


if __name__ == "__main__":
    main()
