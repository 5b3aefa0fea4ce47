"""Demo and test bootstrap, the embedded default model, offline bundles and model sealing."""
