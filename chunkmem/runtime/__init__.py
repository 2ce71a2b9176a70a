"""One prepared model's runtime: hooks into its execution, the optimizer, activations, limits."""
