"""Tree of thought with `fork`: propose several next steps, let the model judge each, keep the
best, and expand it again.

Each fork commits the parent's prompt to the prefix cache once; the branches then read it from
there instead of computing it again (see the cached-token counts printed at the end).

    python examples/tree_of_thought.py
"""
import stemma

GOAL = "Plan a relaxing Saturday in a small town by the sea."
BREADTH, DEPTH = 3, 2


def expand(s, depth):
    """Forks BREADTH candidate steps, scores them, and appends the best one to `s`."""
    branches = s.fork(BREADTH)
    for i, branch in enumerate(branches):
        branch += f"Step {depth}:"
        branch += stemma.gen("step", max_new_tokens=24, stop="\n", temperature=0.8, seed=10 * depth + i)
        branch += "\nIs this a good step towards the goal? Answer yes or no:"
        branch += stemma.select("good", [" yes", " no"])
    scores = [b.meta("good").scores[0] - b.meta("good").scores[1] for b in branches]
    best = max(range(BREADTH), key=scores.__getitem__)
    for i, branch in enumerate(branches):
        mark = "*" if i == best else " "
        print(f"  {mark} step {depth}, idea {i + 1} (yes-no margin {scores[i]:+.2f}):{branch['step']}")
    s += f"Step {depth}:{branches[best]['step']}\n"
    return branches


@stemma.function
def plan(s, goal):
    s += "Break a goal into short, concrete steps.\n\n"
    s += "Goal: Cook a simple dinner for two.\nStep 1: Buy pasta, tomatoes and basil.\n"
    s += "Step 2: Boil the pasta while the sauce simmers.\n\n"
    s += f"Goal: {goal}\n"
    forks = []
    for depth in range(1, DEPTH + 1):
        forks.append(expand(s, depth))
    return forks


def main():
    print(f"Goal: {GOAL}")
    state = plan.run(goal=GOAL)
    print("\nChosen plan:\n" + state.text().split(f"Goal: {GOAL}\n", 1)[1])
    for depth, branches in enumerate(state.return_value, 1):
        commit = [c for c in state.calls() if c.kind == "prefill" and c.name is None][depth - 1]
        cached = [b.calls()[0].cached_tokens for b in branches]
        print(f"level {depth}: prefix of {commit.prompt_tokens} tokens committed once; "
              f"the {BREADTH} branches read {cached} tokens of it from the cache")
    print(f"all calls: {state.usage()}")


if __name__ == "__main__":
    main()
