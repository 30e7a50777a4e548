"""An OpenAI-compatible HTTP server on our classes and continuous-batching engine (`hf-qsa-serve PATH`).

* `cli`: the command; `loading`: the checkpoint on our classes; `app`: the routes, checks and limits;
* `engine`: one manager, each request to its own handler; `prompts`: chat templates and media;
* `text`: incremental text, stop strings; `schemas`: request bodies; `toy`: a small tokenizer for random
  checkpoints (tests, benchmarks, trying it out).
"""
