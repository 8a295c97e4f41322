"""`spec serve-target` and its client: the wire protocol's one home, both sides.

- `wire`: what both sides share: protocol version, token variable, vocab ids, the message format
  (safetensors bytes + JSON metadata; never pickle);
- `server`: request handling, independent of the transport (validation, the model lock);
- `http`: the thin standard-library HTTP layer;
- `run`: `serve()`, what the CLI command calls;
- `client`: `RemoteBackend`, the TargetBackend `spec train --remote` uses.
"""
