//! Model prices and cost arithmetic in integer micro-dollars.
