"""The surgery itself: walk the module graph, plan and apply the rules, fold BN into its producer,
describe a model's BN modules, and the Report of what changed."""
