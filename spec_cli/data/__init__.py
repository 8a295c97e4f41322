"""Chat data -> input_ids + loss_mask."""
