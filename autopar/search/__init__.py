"""Search pass: the best plan under the cost model, with its proven bound."""
