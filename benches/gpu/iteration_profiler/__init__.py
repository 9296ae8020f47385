"""The code behind `benches/gpu/iteration_profile.py`, the script that times real LLM iterations
on one GPU (its docstring and `benches/gpu/README.md` say what it measures and how to run it).

- `plan`: the options, the compositions to time and the seeded plan, sized to the GPU's memory
  and the time budget by a roofline estimate (pure Python: the dry run imports no torch);
- `torch_model`: the random-weight Llama model in plain torch ops, its KV pool and the attention
  backends with their correctness probe (torch is passed in, never imported at module level);
- `runner`: the timer, the profiler that runs a plan, the metadata, the CSV and its sidecar;
- `cli`: the command line;
- `tree`: `evolving_infra.timing`'s `specs.py` and `samples.py`, loaded from the checkout.
"""
