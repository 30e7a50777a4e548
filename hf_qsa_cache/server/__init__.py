"""An OpenAI-compatible HTTP server on our classes and continuous-batching engine (`hf-qsa-serve PATH`).

* `cli`: the command; `loading`: the checkpoint on our classes; `app`: the app's wiring (`build_app`); `served`:
  what it serves and its limits; `checks`: request bodies checked into engine arguments; `runs`: the engine
  requests of one HTTP request, whole or streamed; `routes_chat`, `routes_completions`, `routes_responses`,
  `routes_server` (health, models, load_model, reset): the routes; `errors`: the JSON error body;
* `engine_process`: the engine (model and manager) in a process of its own, the command's default; `engine`: the
  engine in this process, one manager, each request to its own handler; `prompts`: chat templates and media;
* `text`: incremental text, stop strings; `schemas`: request bodies; `toy`: a small tokenizer for random
  checkpoints (tests, benchmarks, trying it out).
"""
