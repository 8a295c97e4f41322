"""Target models: loading, aux-layer capture, supervision."""
