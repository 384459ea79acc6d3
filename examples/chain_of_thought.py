"""Chain of thought: a program that reasons first, then answers, in two calls.

The second call's prompt is the first call's prompt plus its output, token for token, so it is
served almost entirely from the prefix cache; the worked examples are shared by all questions.

    python examples/chain_of_thought.py
"""
import stemma

SHOTS = [
    ("Tom has 3 apples and buys 4 more. How many apples does he have?",
     "Tom starts with 3 apples. He buys 4 more, so 3 + 4 = 7.", "7"),
    ("A box holds 6 eggs. How many eggs are in 5 boxes?",
     "Each box holds 6 eggs. For 5 boxes that is 5 * 6 = 30.", "30"),
    ("Sara had 20 dollars and spent 8. How much money is left?",
     "Sara starts with 20 dollars. She spends 8, so 20 - 8 = 12.", "12"),
]

QUESTIONS = [
    "Ben has 5 pencils and gets 2 more. How many pencils does he have?",
    "A shelf holds 8 books. How many books are on 3 shelves?",
    "Mia had 15 stickers and gave away 6. How many stickers are left?",
]


@stemma.function
def solve(s, question):
    for q, reasoning, answer in SHOTS:
        s += f"Question: {q}\nReasoning: {reasoning}\nAnswer: {answer}\n\n"
    s += f"Question: {question}\nReasoning:"
    s += stemma.gen("reasoning", max_new_tokens=48, stop="\n")
    s += "\nAnswer:"
    s += stemma.gen("answer", max_new_tokens=8, stop="\n")


def main():
    states = solve.run_batch([{"question": q} for q in QUESTIONS], sampling={"temperature": 0})
    for question, state in zip(QUESTIONS, states):
        reasoning_call, answer_call = state.calls()
        print(f"Q: {question}\n   reasoning:{state['reasoning']}\n   answer:{state['answer']}")
        print(f"   the answer call read {answer_call.cached_tokens} of its "
              f"{answer_call.prompt_tokens} prompt tokens from the cache")
    print(f"\nall calls: {states.usage()}")


if __name__ == "__main__":
    main()
