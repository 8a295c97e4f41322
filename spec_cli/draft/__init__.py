"""The draft algorithms (EAGLE-3, EAGLE-1/2, P-EAGLE; one package each) and what they share: the
Llama blocks, the TTT unroll and attention, the losses, decoding."""
