"""Model Runner V2: persistent request state, vectorised input preparation, one runner."""
