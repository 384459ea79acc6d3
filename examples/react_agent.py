"""A ReAct-style agent loop with two local tools: a calculator and a small lookup table.

The program reads the model's choices mid-run (which tool, with what input), calls the tool in
plain Python, and appends the observation. Every turn of the loop extends the same token ids, so
each call reads the whole history so far from the prefix cache.

    python examples/react_agent.py
"""
import ast
import operator

import stemma

FACTS = {
    "height of mount everest": "8849 meters",
    "population of paris": "2100000",
    "year the eiffel tower was finished": "1889",
    "boiling point of water": "100 degrees celsius",
    "number of days in a leap year": "366",
    "length of the nile": "6650 kilometers",
}

EXAMPLE = """\
Answer the question with the tools. lookup[topic] reads a fact from a table.
calculate[expression] does arithmetic. finish[answer] gives the final answer.

Question: What is the population of Paris divided by 1000?
Thought: I need the population of Paris.
Action: lookup
Input: population of paris
Observation: 2100000
Thought: Now I divide 2100000 by 1000.
Action: calculate
Input: 2100000 / 1000
Observation: 2100
Thought: I have the answer.
Action: finish
Input: 2100

Question: How many years ago was the Eiffel Tower finished, counting from 2000?
Thought: I need the year the Eiffel Tower was finished.
Action: lookup
Input: year the eiffel tower was finished
Observation: 1889
Thought: Now I subtract 1889 from 2000.
Action: calculate
Input: 2000 - 1889
Observation: 111
Thought: I have the answer.
Action: finish
Input: 111

"""

# The default model (Gemma 3 270M, a base model) follows the worked example above closely: it
# looks the fact up and then divides, as the example does. So these questions divide; asked for
# another operation it still divides or subtracts ("Everest plus 1000" became `1000 - 8849`).
QUESTIONS = [
    "What is the length of the Nile divided by 10?",
    "What is the number of days in a leap year divided by 2?",
]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.Pow: operator.pow, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """Arithmetic on numbers only: + - * / ** and parentheses."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("not arithmetic")
    try:
        result = value(ast.parse(expression.replace(",", "").strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return f"cannot calculate {expression.strip()!r}"
    return str(int(result) if float(result).is_integer() else round(result, 4))


def lookup(topic: str) -> str:
    """The fact whose key shares the most words with `topic`."""
    words = set(topic.lower().split())
    key = max(FACTS, key=lambda k: len(words & set(k.split())))
    return FACTS[key] if words & set(key.split()) else "no such fact"


TOOLS = {"lookup": lookup, "calculate": calculate}


@stemma.function
def agent(s, question, max_steps=4):
    s += EXAMPLE + f"Question: {question}\n"
    for _ in range(max_steps):
        s += "Thought:" + stemma.gen("thought", max_new_tokens=32, stop="\n") + "\n"
        s += "Action:" + stemma.select("action", [" lookup", " calculate", " finish"]) + "\n"
        s += "Input:" + stemma.gen("input", max_new_tokens=24, stop="\n") + "\n"
        action = s["action"].strip()  # waits for the model: the loop depends on it
        if action == "finish":
            return s["input"].strip()
        s += f"Observation: {TOOLS[action](s['input'])}\n"
    return None


def main():
    for question in QUESTIONS:
        state = agent.run(question=question, sampling={"temperature": 0})
        print(state.text()[len(EXAMPLE):].rstrip())
        print(f"=> final answer: {state.return_value}")
        turns = [c for c in state.calls() if c.kind == "gen" and c.name == "thought"]
        print(f"   each thought read {[c.cached_tokens for c in turns]} of "
              f"{[c.prompt_tokens for c in turns]} prompt tokens from the cache")
        print(f"   {state.usage()}\n")


if __name__ == "__main__":
    main()
