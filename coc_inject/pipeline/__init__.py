"""The CoC engine: chunk layout (pure), schedules, collectives, one autograd Function per case."""
