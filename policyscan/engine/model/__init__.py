"""The model: config and checkpoint checked against each other, precision decided once, the weights streamed to the
device and the decoder built."""
