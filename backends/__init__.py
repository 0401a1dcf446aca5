"""Built-in backend plugins: attention, sampling, grammar."""
