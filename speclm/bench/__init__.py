"""The benchmark harness: speclm's methods beside Hugging Face generate on the same weights.

Modules: `methods` (parsing `draft:k=4` and running each method), `dataset` (Spec-Bench and
JSON-lines prompts), `costs` (the measured cost model), `runner` (the protocol),
`report` (summary, report.md, plots, compare), `machine` (hardware and software facts).
"""
