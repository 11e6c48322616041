"""The switch side: the pure aggregation model, the embedded UDP switch, and its control port."""
