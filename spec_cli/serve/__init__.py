"""`spec serve-target`: the target model behind HTTP, answering supervision requests.

- `wire`: the message format (safetensors bytes + JSON metadata; never pickle);
- `server`: request handling, independent of the transport (validation, the model lock);
- `http`: the thin standard-library HTTP layer;
- `data_plane`: optional tensor transfer over torch.distributed, negotiated over HTTP;
- `run`: `serve()`, what the CLI command calls.
"""
