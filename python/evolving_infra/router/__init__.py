"""The router daemon: the live driver of the policies (DESIGN §1).

- `api`: OpenAI request parsing, error and response/SSE builders (no I/O);
- `branches`: the branch API (headers or the body field `agent`) over the KV directory;
- `tokenize`: prompt -> token ids -> directory block hashes;
- `metrics`: the `evolving_*` Prometheus series;
- `dispatcher`: the `Dispatcher` protocol between the front end and dispatch to the engines;
- `app`: the aiohttp front end around a `Dispatcher`;
- `config`: `RouterConfig` from flags and a TOML file;
- `ingest`: KV-event ingestion from the engines into the directory.

Submodules are imported on use: importing this package pulls in neither aiohttp nor ZMQ.
"""
