"""The lab: students write ZeRO's pieces themselves, and an autograder checks them.

    python -m minizero.lab make zero-lab/                    # the student's copy
    python -m minizero.lab check zero1 --student zero-lab/   # grade one part (partition, zero1, zero2, zero3, fp16, all)
    python -m minizero.lab check all                         # grade minizero itself: the answer key passes

Courses that teach distributed training by building it (CS336's assignment 2, the better
distributed-systems courses) grade against their own reference; none against the library
students will meet at work. This one grades against minizero's own code and, where it is
installed, DeepSpeed's, and says what a difference means in the lesson's terms.

`make` (make.py) copies the core files that hold a part's pieces, with those pieces' bodies
removed and their docstrings kept as the specification, plus a README with each part's task:
generated from the files the engine runs, so the copy never drifts from them, and holding no
line of the removed code. `check` (run.py, then grade.py) starts 2 ranks once, loads the student's files in
place of minizero's (an import hook: nothing of minizero is patched), runs the part's
scenarios with the student's code and with minizero's, and compares, per scenario: losses and
final weights bit for bit, the ledger's calls and bytes per collective in a step, where the
collectives ran (inside backward or after it), the model-state bytes per rank
(`engine.memory_breakdown`) and, at ZeRO-3, the parameter bytes gathered at their peak; then,
where DeepSpeed is installed, the losses against DeepSpeed's (bit for bit in fp32: the
configuration `python -m minizero.selftest` checks). A difference is turned into what it means
(parts.py: each part's diagnoses), e.g. "you all-reduced where a reduce-scatter belongs".

mistakes.py holds typical wrong answers for each part, each with the message it must draw:
`check PART --mistake K` grades one, and the tests hold every message.
"""
