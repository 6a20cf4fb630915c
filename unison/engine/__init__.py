"""The engine: what moves bytes. Flat gradient buckets, the reducer that drives
them through one synchronized backward, collective helpers, wire codecs and
tensor averaging. It knows no algorithm: the reducer asks its questions through
the policy it is given (``unison.events.Dispatcher``)."""
