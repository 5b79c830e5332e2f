"""CPU math: oneDNN matmul on packed weights, projection layouts for Paddle's matmul, and the process's math-library setup; imports nothing else of warmfleet."""
