"""Multi-turn chat with system/user/assistant turns.

Turns are rendered with the tokenizer's chat template. The default model (Gemma 3 270M base) has
none, so stemma uses its plain fallback (`User: ...`, `Assistant: ...`, see
stemma/lang/chat_template.py); a base model also needs an example exchange to follow. Each turn's
prompt is the previous one plus the reply, so every turn reads the conversation so far from the
prefix cache.

    python examples/multi_turn_chat.py
"""
import stemma

EXAMPLE = [
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("What is a famous building there?", "The Colosseum is a famous building in Rome."),
]
QUESTIONS = [
    "What is the capital of France?",
    "What is a famous tower there?",
    "What is the capital of Japan?",
]


@stemma.function
def chat(s, questions):
    s += stemma.system("You are a helpful assistant. Answer in one short sentence.")
    for question, answer in EXAMPLE:
        s += stemma.user(question) + stemma.assistant(answer)
    for i, question in enumerate(questions):
        s += stemma.user(question)
        s += stemma.assistant(stemma.gen(f"reply{i}", max_new_tokens=32))


def main():
    state = chat.run(questions=QUESTIONS, sampling={"temperature": 0})
    for message in state.messages()[1 + 2 * len(EXAMPLE):]:
        print(f"{message['role']:>9}: {message['content'].strip()}")
    print()
    for i, call in enumerate(state.calls()):
        print(f"turn {i + 1}: {call.cached_tokens} of {call.prompt_tokens} prompt tokens from the cache")
    print(f"all calls: {state.usage()}")


if __name__ == "__main__":
    main()
